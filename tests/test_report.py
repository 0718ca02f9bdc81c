"""Renderers of one Result: report.html, summary.md, junit.xml (qual.report)."""

from __future__ import annotations

import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import replace

import markupsafe
import pytest

from qual.records import GraphCapture

from qual.report import baseline as bview
from qual.report import common, html, junit, markdown, write_reports
from qual.shown import command, safe
from qual import history
from qual.harness.build import build_result
from synthetic import as_baseline, synthetic_gate, synthetic_pair, synthetic_result, synthetic_run_info, truncated

HOSTILE = ["<script>alert(1)</script>", "</textarea><b>x", 'a"b\'c&d|e`f']


def _hostile_result(p_candidate: float = 0.68):
    """A failing result whose corpus text (ids, categories, name, command) is hostile."""
    control, candidate = synthetic_pair(30, 0.75, p_candidate, categories=HOSTILE)
    rename = {r.id: f"{r.id}<script>alert(2)</script>" for r in control}
    control = [replace(r, id=rename[r.id]) for r in control]
    candidate = [replace(r, id=rename[r.id]) for r in candidate]
    res = synthetic_result(
        pair=(control, candidate),
        control_graph=GraphCapture("captured", "FULL", [1, 2, 4, 8], 3.2, 2**29),
        candidate_graph=GraphCapture("captured", "FULL", [1, 2, 4], 3.0, 2**29, detail="<img src=x onerror=alert(3)>"),
    )
    res.corpus.name = "</textarea><script>alert(4)</script>"
    res.reproduce = "qual run --corpus '</textarea><script>alert(5)</script>' --dcp 4"
    return res


@pytest.fixture(scope="module")
def hostile():
    return _hostile_result()


def test_html_escapes_hostile_text(hostile):
    page = html.render(hostile)
    assert "<script" not in page.lower()
    assert "</textarea>" not in page
    assert "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;/textarea&gt;" in page
    assert "&lt;img src=x onerror=alert(3)&gt;" in page


def test_html_is_self_contained(hostile):
    page = html.render(hostile)
    # No resource is loaded from anywhere: no src/href to a URL, no stylesheets or scripts, a CSP forbidding loads.
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert not re.search(r"<(?:script|link|iframe|object|embed)\b", page, re.I)
    assert "@import" not in page and not re.search(r"url\((?!#)", page)  # only in-page SVG references
    assert "default-src 'none'" in page
    assert page.count("<svg") == 2  # both plots inline


def test_html_content_for_a_reviewer(hostile):
    page = html.render(hostile)
    # Verdict first, failing checks listed before anything else.
    assert page.index(">FAIL<") < page.index("Failing checks") < page.index("Headline")
    for text in ("Acceptance per draft position", "conditional", "Per-request paired deltas", "Per category",
                 "CUDA-graph capture", "Configuration", "fingerprint", "Reproduce", hostile.corpus.fingerprint):
        assert text in page
    # Config diff highlights exactly the differing key (dcp).
    assert re.search(r'<tr class="diff"><td><code>dcp</code></td><td>1</td><td>4</td></tr>', page)
    assert page.count('<tr class="diff"><td><code>') == 1


def test_html_is_deterministic(hostile):
    assert html.render(hostile) == html.render(hostile)


def test_markdown_summary(hostile):
    md = markdown.render(hostile)
    lines = md.splitlines()
    assert lines[0].startswith("## ❌ FAIL: qual toy: DCP 1 → DCP 4")
    assert re.search(r"^\| acceptance rate \| \d+\.\d\d% \| \d+\.\d\d% \| -\d+\.\d\d pp \(95% CI \[", md, re.M)
    check_rows = [ln for ln in lines if ln.startswith("| ✅ |") or ln.startswith("| ❌ |")]
    assert len(check_rows) == len(hostile.gate.checks)
    assert sum(ln.startswith("| ❌ |") for ln in check_rows) == len(hostile.gate.failed)
    # Untrusted text is inert in a GitHub step summary: rendered by CommonMark (raw HTML allowed, as GitHub allows
    # some), no tag of it is a tag; pipes escaped in cells.
    rendered = _commonmark().render(md)
    assert "<script" not in rendered and "</textarea>" not in rendered and "<img" not in rendered
    assert [t.content for t in _code_spans(md) if "textarea" in t.content] == [hostile.corpus.name]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in md
    assert "a\"b'c&amp;d\\|e\\`f" in md
    assert "```sh\n" + hostile.reproduce + "\n```" in md  # literal inside a fence


def _commonmark():
    """CommonMark with GFM's tables (markdown-it, a renderer nobody here wrote): how GitHub reads summary.md."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table")


def _code_spans(md: str) -> list:
    return [child for token in _commonmark().parse(md) if token.type == "inline" for child in token.children
            if child.type == "code_inline"]


SPAN_TEXTS = ["plain", "`qual history baseline pin ID`", "a``b`c", "```", "`", " lead", "trail ", " both ", "  ",
              "x|y", "a \\| b", "<script>alert(1)</script>", "a &amp; b", "back\\slash\\", "*not* _emph_ [l](u)",
              "line\nbreak", "tab\there"]


@pytest.mark.parametrize("in_table", [False, True])
@pytest.mark.parametrize("text", SPAN_TEXTS)
def test_a_code_span_renders_any_text_as_written(text, in_table):
    """summary.md's code spans (markdown.code) hold any text as written, in a paragraph and in a table cell: a span
    fenced by more backticks than any run inside (CommonMark), never a backslash before a backtick (inside a span
    it is a backslash, and the span ends early)."""
    span = markdown.code(text, in_table)
    doc = f"| a | b |\n|---|---|\n| {span} | z |\n" if in_table else f"x {span} y\n"
    shown = safe(" ".join(text.splitlines()))  # a line break is a space; a control character its escape (qual.shown)
    assert [t.content for t in _code_spans(doc)] == [shown], doc
    if in_table:
        assert re.findall(r"<td>(.*?)</td>", _commonmark().render(doc))[1] == "z"  # the row kept its two cells


def test_the_pin_hint_is_a_command_that_pins_this_night(against_baseline, tmp_path):
    """A night compared with the series before its own says how to pin it: the command names this night's folder and
    its history, and is a code span that renders (it was an escaped backtick, shown as text)."""
    b = replace(against_baseline.baseline, chosen_by="previous series",
                key_differences=[{"key": "draft", "tonight": "sha256:new", "baseline": "sha256:old"}])
    res = replace(against_baseline, baseline=b)
    folder, db = tmp_path / "night 2", tmp_path / "h.sqlite"
    pin = command(["qual", "history", "baseline", "pin", folder, "--history", db])
    spans = [t.content for t in _code_spans(markdown.render(res, folder, db))]
    assert pin in spans and not [s for s in spans if "`" in s]
    page = html.render(res, folder, db)
    assert f"{markupsafe.escape(bview.PIN_HINT)}: <code>{markupsafe.escape(pin)}</code>" in page
    assert "pin this night" not in markdown.render(against_baseline, folder, db)  # its own series: nothing to pin


def test_markdown_pass_golden_lines():
    md = markdown.render(synthetic_result(12))
    assert md.splitlines()[0] == "## ✅ PASS: qual toy: DCP 1 → DCP 4 (reference, TP 4, draft KV replicated)"
    assert "| ✅ | graph_sizes_captured | graph capture unsupported in both arms: nothing to compare |" in md
    assert "| target outputs identical |  |  | yes (12/12) |" in md


def test_junit_one_testcase_per_check(hostile):
    xml = junit.render(hostile)
    root = ET.fromstring(xml.encode())
    cases = root.findall(".//testcase")
    assert [c.get("name") for c in cases] == [c.name for c in hostile.gate.checks]
    assert root.get("tests") == str(len(hostile.gate.checks))
    assert root.get("failures") == str(len(hostile.gate.failed)) != "0"
    for case, check in zip(cases, hostile.gate.checks):
        failure = case.find("failure")
        if check.passed:
            assert failure is None
        else:
            assert failure.get("message") == check.detail == failure.text
    graph = next(c for c in cases if c.get("name") == "graph_sizes_captured")
    assert "<img src=x onerror=alert(3)>" in graph.find("failure").text  # escaped in XML, intact once parsed
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["corpus"] == hostile.corpus.name


def test_junit_survives_control_characters():
    res = synthetic_result(5)
    res.gate.checks[0].detail = "bad\x00byte\x1b[31m"
    ET.fromstring(junit.render(res).encode())


def test_junit_of_a_run_without_a_verdict_is_one_error_naming_the_cause():
    """Exits 3 and 4 leave one test case in error: the cause on one line, secret shapes redacted, XML-safe."""
    message = "engine failure: server said\nHTTP 500 hf_AbCdEfGhIjKlMnOpQrSt \x1b[2J (log: /tmp/x.log)"
    root = ET.fromstring(junit.render_error("qual.gate.toy.dcp4", "engine_failure", message, "EngineError",
                                            "2026-12-01T00:00:00+00:00").encode())
    assert (root.get("tests"), root.get("errors"), root.get("failures")) == ("1", "1", "0")
    [case] = root.findall(".//testcase")
    assert case.get("name") == "engine_failure" and case.get("classname") == "qual.gate.toy.dcp4"
    error = case.find("error")
    assert error.get("type") == "EngineError" and error.text == error.get("message")
    assert error.get("message") == "engine failure: server said HTTP 500 <redacted> \ufffd[2J (log: /tmp/x.log)"


def test_write_reports(tmp_path):
    paths = write_reports(synthetic_result(8), tmp_path / "out")
    assert {p.name for p in paths.values()} == {"result.json", "report.html", "summary.md", "junit.xml"}
    assert all(p.stat().st_size > 0 for p in paths.values())


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(url: str, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
        "--enable-logging=stderr", "--v=0", *extra, url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_report_opens_in_headless_chromium_without_console_errors(tmp_path, hostile):
    path = html.write(hostile, tmp_path / "report.html")
    run = _chromium(path.as_uri(), tmp_path, "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    console = [ln for ln in run.stderr.splitlines() if ":CONSOLE" in ln]
    assert console == [], console
    assert "Failing checks" in run.stdout and "&lt;script&gt;alert(1)&lt;/script&gt;" in run.stdout
    # The detector is live: a page that breaks the rules does produce console lines.
    bad = tmp_path / "bad.html"
    bad.write_text(page_with_violation(path.read_text()))
    run = _chromium(bad.as_uri(), tmp_path, "--dump-dom")
    assert any(":CONSOLE" in ln for ln in run.stderr.splitlines()), run.stderr[-2000:]


def page_with_violation(page: str) -> str:
    """The report with a script injected after escaping: its CSP must block it and say so."""
    return page.replace("</main>", "<script>console.log('ran')</script></main>")


def test_throughput_row_leads_with_generation_where_timed():
    """The first arm of a process pays one-time CUDA costs at start-up: where the engine timed generation apart,
    the report shows that rate first, and the whole-arm rate after it."""
    from qual.report.common import throughput
    from qual.result import Throughput

    assert throughput(Throughput(2.0, 1000, 500.0)) == "500.0 tok/s"
    assert throughput(Throughput(2.0, 1000, 500.0, 0.5)) == "2000.0 tok/s generating (500.0 tok/s with start-up)"


# ---------------------------------------------------------------- the baseline section


@pytest.fixture(scope="module")
def against_baseline(tmp_path_factory):
    """Tonight's hostile run (both arms lose from position 3 on) against last night's, with a trend of 3 runs."""
    base = _hostile_result(p_candidate=0.75)
    root = tmp_path_factory.mktemp("bl")
    resolved = as_baseline(base, root / "night1" / "result.json", history_id=2, chosen_by="pinned")
    db = root / "h.sqlite"
    for day in (1, 2, 3):
        history.record_run(db, replace(base, created_at=f"2026-11-2{day}T02:00:00+00:00"), resolved.path)
    control, candidate = (truncated(a.per_request, 3) for a in (base.control, base.candidate))
    rules = [{"check": "per_position_delta", "max_pp": 2.0}, {"check": "acceptance_floor", "min_rate": 0.1, "models": ["glm"]}]
    return build_result(base.corpus, (base.control.config, synthetic_run_info(control), control),
                        (base.candidate.config, synthetic_run_info(candidate), candidate), synthetic_gate(rules), 0,
                        n_resamples=100, baseline=resolved, trend=history.list_runs(db))


def test_html_baseline_section(against_baseline, hostile):
    page = html.render(against_baseline)
    section = page[page.index("Against the baseline"):page.index("Acceptance per draft position")]
    assert "run 2 (pinned)" in section and "pinned (history run 2)" in section
    assert section.count("<svg") == 1 and "last 3 recorded runs" in section  # the trend strip
    strip = section[section.index("<svg"):section.index("</svg>")]
    assert ">tonight</text>" in strip and ">baseline</text>" in strip  # tonight named, the baseline ringed
    assert "<script" not in page.lower() and "&lt;script&gt;alert(2)&lt;/script&gt;" in section  # moved request ids
    # per-position rows: positions 0-2 unchanged, 3-6 dropped (flagged) in both arms
    rows = re.findall(r'<tr><td class="n">(\d)</td>(.*?)</tr>', section)
    assert [int(i) for i, _ in rows] == list(range(7))
    flagged = [int(i) for i, cells in rows if 'class="n neg"' in cells]
    assert flagged == [3, 4, 5, 6]
    assert "Against the baseline" not in html.render(hostile)


def test_markdown_and_junit_baseline(against_baseline, hostile):
    md = markdown.render(against_baseline)
    assert "### Against the baseline: run 2 (pinned)" in md
    assert re.search(r"^\| control \| 30 \| \d+\.\d\d% \| \d+\.\d\d% \| -\d+\.\d\d pp \[", md, re.M)
    assert re.search(r"^\| 3 \| .* \(\*\*-\d+\.\d\d pp\*\*\) \| .* \(\*\*-\d+\.\d\d pp\*\*\) \|$", md, re.M)
    assert "Moved most: `r0" in md and "<script" not in _commonmark().render(md)
    assert "Candidate over the last 3 runs of this configuration and tonight: " in md and "(baseline)" in md
    assert "Against the baseline" not in markdown.render(hostile)
    root = ET.fromstring(junit.render(against_baseline).encode())
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["baseline"] == "run 2 (pinned)" and float(props["baseline_delta_candidate_rate"]) < 0
    # a check that did not apply is a skipped test case, not a passed one
    suite = root.find("testsuite")
    assert suite.get("skipped") == "1" and suite.get("failures") == "1"
    floor = next(c for c in root.iter("testcase") if c.get("name") == "acceptance_floor")
    assert floor.find("skipped").get("message").startswith("skipped: floors set for model(s) glm")


def test_a_result_with_a_baseline_round_trips(against_baseline, tmp_path):
    from qual.result import load_result, save_result

    back = load_result(save_result(against_baseline, tmp_path / "result.json"))
    assert back.to_json() == against_baseline.to_json() and back.baseline.label == "run 2 (pinned)"


# Three recorded nights before tonight: (engine version, qual commit, --meta deploy); tonight's engine is the synthetic
# runs' own (qual-reference 0.1.0), its qual this checkout's, its deploy d4
STRIP_NIGHTS = [("qual-reference 0.1.0", "1" * 40, "d1"), ("qual-reference 0.2.0", "1" * 40, "d2"),
                ("qual-reference 0.2.0", "2" * 40, "d3")]


def _strip_result(root, axis: str):
    """Tonight against night 2 of three recorded nights whose engine and --meta deploy differ, drawn along axis."""
    base = _hostile_result(p_candidate=0.75)
    resolved = as_baseline(base, root / "night" / "result.json", history_id=2, chosen_by="pinned")
    db = root / "h.sqlite"
    for day, (engine, commit, deploy) in enumerate(STRIP_NIGHTS, 1):
        provenance = replace(base.candidate.provenance, qual_version="0.1.0", qual_commit=commit,
                             qual_checkout_dirty=False)
        night = replace(base, created_at=f"2026-11-2{day}T02:00:00+00:00", meta={"deploy": deploy},
                        candidate=replace(base.candidate, engine_version=engine, provenance=provenance))
        history.record_run(db, night, resolved.path)
    return build_result(base.corpus, (base.control.config, synthetic_run_info(base.control.per_request),
                                      base.control.per_request),
                        (base.candidate.config, synthetic_run_info(base.candidate.per_request),
                         base.candidate.per_request), synthetic_gate([]), 0, n_resamples=50, baseline=resolved,
                        trend=history.list_runs(db), meta={"deploy": "d4"}, axis=axis)


def _strip_svg(result) -> str:
    page = html.render(result)
    section = page[page.index("Against the baseline"):page.index("Acceptance per draft position")]
    return section[section.index("<svg"):section.index("</svg>")]


@pytest.mark.parametrize("axis, labels", [
    # a column a night, labelled where the value changes: tonight's engine is the first night's again
    ("engine", ["qual-reference 0.1.0", "qual-reference 0.2.0", "qual-reference 0.1.0"]),
    ("qual", ["0.1.0 111111111111", "0.1.0 222222222222", "tonight's"]),
    ("meta:deploy", ["d1", "d2", "d3", "d4"]),
])
def test_the_strip_runs_along_the_recorded_axis(tmp_path, axis, labels):
    from qual.nights import facts_of

    result = _strip_result(tmp_path, axis)
    labels = [facts_of(result)["qual"] if label == "tonight's" else label for label in labels]
    assert result.baseline.axis == axis
    assert [(t["engine"], t["qual"], t["meta"]) for t in result.baseline.trend] == [
        (engine, f"0.1.0 {commit[:12]}", {"deploy": deploy}) for engine, commit, deploy in STRIP_NIGHTS]
    strip = _strip_svg(result)
    texts = re.findall(r">([^<>]+)</text>", strip)
    assert texts[:len(labels) + 1] == [*labels, axis]  # the columns' labels, then the axis's name
    # the engine's changes are marked along any axis; tonight named, the baseline ringed
    marks = texts[len(labels) + 1:]
    assert {"qual-reference 0.2.0", "qual-reference 0.1.0", "engine changed", "tonight", "baseline"} <= set(marks)
    assert f"tonight, along {axis} (qual run --axis)" in html.render(result)


def test_a_result_from_before_the_strip_had_an_axis_renders_along_the_date(tmp_path):
    import json

    from qual.errors import QualError
    from qual.result import load_result, save_result

    path = save_result(_strip_result(tmp_path, "meta:deploy"), tmp_path / "result.json")
    old = json.loads(path.read_text())
    del old["baseline"]["axis"]
    for night in old["baseline"]["trend"]:
        del night["qual"], night["meta"]
    path.write_text(json.dumps(old))
    back = load_result(path)
    assert back.baseline.axis == "date"
    strip = _strip_svg(back)
    assert ">meta:deploy</text>" not in strip and ">d1</text>" not in strip and ">tonight</text>" in strip
    assert "tonight, along the date (UTC)" in html.render(back)
    old["baseline"]["axis"] = "gpu"  # no axis qual draws: refused by name, not drawn along nothing
    path.write_text(json.dumps(old))
    with pytest.raises(QualError, match=r"baseline\.axis: expected date, engine, qual or meta:KEY, got 'gpu'"):
        load_result(path)


def _vllm_result(tmp_path):
    """A result whose arms ran on vLLM builds that differ in what the report must surface."""
    from qual.records import EngineBuild, HostFacts

    res = synthetic_result(6)
    logs = tmp_path / "run"
    logs.mkdir()
    for arm, knorm, kv in ((res.control, "yes", "yes"), (res.candidate, "no", "unknown")):
        arm.log_path = str(logs / f"{arm.config['dcp']}.vllm.log")
        arm.extra = {"acceptance_source": "per-request metrics (detailed)", "server_command": "vllm serve /m --x <b>",
                     "dflash_context_knorm_per_layer_in_build": knorm, "draft_kv_replicated_in_build": kv}
        arm.provenance.engine = EngineBuild("vllm", "0.32.0", None, HostFacts(cpu_model="AMD EPYC", source="t"))
    for r in res.candidate.per_request:
        r.acceptance_source = "per_request_metrics"
    res.candidate.throughput.generate_seconds = res.control.throughput.generate_seconds = 1.0
    res.control.throughput.output_tokens, res.candidate.throughput.output_tokens = 1000, 800
    return res, logs


def test_report_carries_the_engines_facts(tmp_path):
    res, logs = _vllm_result(tmp_path)
    page = html.render(res, logs)
    md = markdown.render(res)
    for text in (md, page):
        assert "k_norm CPU bug present" in text  # the candidate's build
        assert "replicated (the build keeps draft KV unsharded under DCP)" in text
        assert "per-request metrics (detailed) (per-request metrics: 6 requests)" in text
        assert "vllm 0.32.0 (no commit recorded)" in text and "CPU AMD EPYC" in text
    assert '<a href="1.vllm.log">' in page and '<a href="4.vllm.log">' in page  # relative to the page's folder
    assert "vllm serve /m --x &lt;b&gt;" in page  # a server command is untrusted text too
    assert "| throughput |" in md and "-20.0% (×0.80, generating)" in md


# ---------------------------------------------------------------- per position, per request, the files beside


def test_per_position_rows_carry_the_bootstrap_intervals(hostile):
    page = html.render(hostile)
    section = page[page.index("Acceptance per draft position"):page.index("Per-request paired deltas")]
    assert "Whiskers: each arm's 95% interval" in section and "the same 500 resamples, seed 0" in section
    rows = re.findall(r'<tr>\s*<td class="n">(\d)</td>(.*?)</tr>', section, re.S)
    assert [int(i) for i, _ in rows] == [p["position"] for p in hostile.comparison.per_position] == list(range(7))
    for (_, cells), p in zip(rows, hostile.comparison.per_position):
        assert common.ci_pp(p["ci"], False) in cells and common.ci_pp(p["conditional_ci"], False) in cells
    older = replace(hostile, comparison=replace(hostile.comparison, per_position=[]))
    assert "No intervals: this result carries none per position." in html.render(older)


def test_every_request_is_listed_largest_drop_first(hostile):
    page = html.render(hostile)
    table = page[page.index('<table id="all-requests">'):]
    table = table[:table.index("</table>")]
    ids = re.findall(r'<td class="id"><code>(.*?)</code></td>', table)
    deltas = sorted(hostile.comparison.per_request_deltas, key=lambda r: (r["delta"] is None, r["delta"] or 0.0))
    assert len(ids) == len(hostile.control.per_request) == 30
    assert ids == [markupsafe.escape(r["id"]) for r in deltas]
    assert page.index("<details>") < page.index('<table id="all-requests">')  # collapsed until opened
    n_tokens = {r.id: len(r.output_token_ids) for r in hostile.control.per_request}
    first = deltas[0]
    assert re.search(rf'<td class="n">{n_tokens[first["id"]]}</td></tr>', table)


def test_links_to_the_files_beside_the_report(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("control.requests.jsonl", "candidate.requests.jsonl", "control.vllm.log", 'odd "<name>".log'):
        (out / name).write_text("x\n")
    (out / "linked.log").symlink_to(out / "control.vllm.log")
    page = write_reports(synthetic_result(6), out)["html"].read_text()
    section = page[page.index('<h2 id="files">'):]
    hrefs = re.findall(r'<a href="([^"]*)">', section)
    # result.json, summary.md and junit.xml are written before the page, so it finds them; no run.json here
    assert hrefs == ["result.json", "summary.md", "junit.xml", "candidate.requests.jsonl", "control.requests.jsonl",
                     "control.vllm.log", "odd%20%22%3Cname%3E%22.log"]
    assert all(not h.startswith(("/", "file:")) for h in hrefs)  # relative: the folder opens anywhere
    assert "odd &#34;&lt;name&gt;&#34;.log" in section and '<a href="#files">files</a>' in page
    assert '<h2 id="files">' not in html.render(synthetic_result(6))  # no folder, no links


def test_per_position_figure_draws_one_whisker_per_interval():
    from qual.report import plots

    rates = [0.7, 0.5, 0.3]
    bare = plots.per_position_svg(rates, rates, rates, rates).count("<use")  # tick marks
    intervals = {"control": [[0.6, 0.8]] * 3, "candidate": [[0.6, 0.8], None, [0.2, 0.4]],
                 "candidate_conditional": [[0.65, 0.75]]}  # shorter than the bars: the rest have none
    drawn = plots.per_position_svg(rates, rates, rates, rates, intervals).count("<use")
    assert drawn - bare == 2 * 6  # two caps a whisker


def _sweep(hostile):
    """A sweep of two candidates against one control: the hostile result's, and one whose candidate passes."""
    from qual.sweep_result import SweepResult

    control, _ = synthetic_pair(30, 0.75, 0.68, categories=HOSTILE)
    passing = synthetic_result(pair=(control, control), dcp=2)
    passing.control = hostile.control  # one control for both
    return SweepResult.of([("candidate-dcp2", passing), ("candidate-dcp4", hostile)])


def test_a_sweeps_page_holds_the_matrix_and_each_candidates_detail(hostile):
    sweep = _sweep(hostile)
    page = html.render_sweep(sweep)
    assert "<script" not in page.lower() and "</textarea>" not in page and "<img src=x" not in page
    assert not re.search(r"<(?:script|link|iframe|object|embed)\b", page, re.I) and "default-src 'none'" in page
    assert page.index(">FAIL<") < page.index('id="matrix"') < page.index('id="candidate-dcp2"') < \
        page.index('id="candidate-dcp4"')
    assert page.count("<svg") == 4 and page.count('<section class="candidate"') == 2
    ids = re.findall(r'\sid="([^"]+)"', page)
    referenced = set(re.findall(r"url\(#([^)]+)\)", page)) | set(re.findall(r'href="#([^"]+)"', page))
    assert referenced and all(ids.count(i) == 1 for i in referenced)  # every in-page reference finds one element
    for name in ("candidate-dcp2", "candidate-dcp4"):
        assert f'id="{name}-headline"' in page and f'href="#{name}"' in page
    assert html.render_sweep(sweep) == page


def test_a_sweeps_summary_and_junit(hostile):
    sweep = _sweep(hostile)
    md = markdown.render_sweep(sweep)
    assert md.startswith("## ❌ FAIL: qual toy: DCP 1 → 2 candidates (DCP 2, 4; ")
    rows = [line for line in md.splitlines() if line.startswith("| `candidate-dcp")]
    assert len(rows) == 2 and "✅ PASS" in rows[0] and "❌ FAIL" in rows[1]
    root = ET.fromstring(junit.render_sweep(sweep).encode())
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["qual.gate.toy.dcp2", "qual.gate.toy.dcp4"]
    assert int(root.get("failures")) == sum(int(s.get("failures")) for s in suites) > 0
    assert [int(s.get("failures")) for s in suites][0] == 0


def test_too_few_requests_for_the_intervals_is_said_beside_the_verdict_everywhere(tmp_path, capsys):
    """Below qual.intervals.MIN_UNITS the intervals under-cover: stdout, summary.md and report.html say so next to
    the verdict (a sweep's too); the verdict and the exit code stay the gate's."""
    from cli_inprocess import qual_in

    from qual.cli.verdict import print_sweep_verdict
    from qual.intervals import MIN_UNITS
    from qual.report import json as json_report
    from qual.sweep_result import SweepResult

    few = synthetic_result(MIN_UNITS - 1, 0.75, 0.6, n_resamples=200)
    same = synthetic_result(MIN_UNITS - 1, n_resamples=200)  # identical arms: [0, 0], a pass
    note = common.interval_note(few)
    assert note.startswith(f"{MIN_UNITS - 1} requests: below {MIN_UNITS} the intervals cover less than")
    assert common.interval_note(same) == note and same.gate.passed and not few.gate.passed
    enough = synthetic_result(MIN_UNITS, 0.75, 0.6, n_resamples=200)
    assert common.interval_note(enough) is None and "intervals cover less" not in markdown.render(enough)
    for name, res in (("few", few), ("same", same)):
        json_report.write(res, tmp_path / name / "result.json")
        out = tmp_path / f"{name}-compared"
        shown = qual_in(capsys, "compare", f"{tmp_path / name}:control", f"{tmp_path / name}:candidate", "--out", out)
        lines = shown.stdout.splitlines()
        assert shown.returncode == (0 if res.gate.passed else 1), shown
        assert lines[0].startswith("PASS: " if res.gate.passed else "FAIL: ") and lines[1] == f"  note: {note}", lines
        summary = (out / "summary.md").read_text().splitlines()  # the note follows the count of checks passed
        assert re.match(r"\d+/\d+ gate checks passed ", summary[summary.index(f"⚠️ {markdown.cell(note)}.") - 2])
        page = (out / "report.html").read_text()
        assert page.index('class="verdict') < page.index(str(markupsafe.escape(note))) < page.index("</section>")
    # where the corpus holds conversations the unit is the conversation, and the note counts conversations
    turns = replace(few, comparison=replace(few.comparison, bootstrap={**few.comparison.bootstrap,
                                                                         "unit": "conversation", "n_requests": 1}))
    assert common.interval_note(turns).startswith("1 conversation: below ")
    sweep = SweepResult.of([("candidate-dcp4", few)], notes=["the control runs once, at TP 4"])
    print_sweep_verdict(sweep, tmp_path)
    shown = capsys.readouterr()
    assert shown.out.splitlines()[1] == f"  note: {note}" and shown.err == "note: the control runs once, at TP 4\n"
    assert f"⚠️ {markdown.cell(note)}." in markdown.render_sweep(sweep)
