"""`qual history publish DIR` (qual.report.site): the static site of a run history, from real runs of the toy pair
and synthetic nights (one failing, one without a verdict, an engine upgrade); every link resolves inside DIR, failed
and error nights and engine changes are marked on every plot, and the pages fit a desktop and a phone in headless
Chromium."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from devtools import Browser
from qual import history
from qual.cli import history as _registers_history  # noqa: F401  (puts `history` on the app run_app runs)
from qual.cli.main import run_app
from qual.report import site as published
from qual.report import plots, write_reports
from qual.result import load_result
from synthetic import synthetic_result

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
VIEWPORTS = {"desktop": (1400, 900), "phone": (390, 844)}
# Synthetic nights of one configuration: (day, candidate's acceptance probability, fake qual commit); 0.62 fails.
SYNTHETIC = [(20 + i, p, f"{c:07x}" + "0" * 33) for i, (p, c) in
             enumerate(zip((0.75, 0.75, 0.77, 0.62, 0.75, 0.75, 0.76, 0.75), range(0xa11ce00, 0xa11ce08)))]
MISSING_DAY = 25  # this night's run folder is deleted: it is plotted from its history row only
UPGRADE_DAY, UPGRADED = 26, "qual-reference 0.2.0"  # from this night on the engine reports another version
ERROR_AT, ERROR_CAUSE = "2026-11-23T14:00:00+00:00", "engine failure: the server went away"  # a night without a verdict


def _qual_run(out: Path, db: Path, *extra: str) -> int:
    # Four tokens a request: the site shows runs, not answers, and the sharded drafter still fails at four (its
    # candidate accepts ~9% against the control's ~32%).
    cmd = [sys.executable, "-m", "qual", "run", "--dcp", "2", "--limit", "4", "--max-tokens", "4", *extra,
           "--out", str(out), "--history", str(db)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600).returncode


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    """Two real runs of the toy pair (one replicated, passing; one sharded, failing), a second night of the passing
    one (its result re-dated a day later, reports re-rendered), and eight synthetic nights of a third configuration,
    one failing and one whose folder is gone."""
    root = tmp_path_factory.mktemp("history")
    path = root / "history.sqlite"
    assert _qual_run(root / "real-pass", path) == 0
    assert _qual_run(root / "real-sharded", path, "--draft-kv", "sharded") == 1
    first = load_result(root / "real-pass" / "result.json")
    later = replace(first, created_at=(datetime.fromisoformat(first.created_at) + timedelta(days=1)).isoformat())
    history.record_run(path, later, write_reports(later, root / "real-pass-2")["json"])
    for day, p, commit in SYNTHETIC:
        res = synthetic_result(24, 0.75, p, n_resamples=200, created_at=f"2026-11-{day:02d}T02:00:00+00:00")
        res.candidate.provenance.qual_commit = commit
        if day >= UPGRADE_DAY:
            res.candidate.engine_version = UPGRADED
        night = root / f"synthetic-{day}"
        history.record_run(path, res, write_reports(res, night)["json"])
        if day == MISSING_DAY:
            shutil.rmtree(night)
        if ERROR_AT.startswith(f"2026-11-{day:02d}"):  # the nights are recorded in the order they ran
            _record_error_night(path, res, root / "synthetic-error")
    return path


def _record_error_night(path: Path, res, failed: Path) -> None:
    """A night of res's configuration that ended in exit 3, as `qual run` leaves it: run.json, summary.md, its row."""
    failed.mkdir()
    (failed / "run.json").write_text(json.dumps({"run_id": "night-error"}))
    (failed / "summary.md").write_text(f"# ERROR (exit 3)\n\n{ERROR_CAUSE}\n")
    history.record_error(path, history.ErrorNight(
        created_at=ERROR_AT, run_id="night-error",
        arms={"control": res.control.config, "candidate": res.candidate.config},
        corpus={"name": "synthetic", "fingerprint": res.corpus.fingerprint, "count": 24},
        key=history.configuration_of(res), exit_code=3, cause=ERROR_CAUSE, command="qual run --dcp 4",
        run_dir=str(failed)))


@pytest.fixture(scope="module")
def site(db, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "pub"
    assert run_app(["history", "publish", str(out), "--history", str(db)]) == 0
    return out


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.srcs: list[str] = []
        self.tags: list[str] = []
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)
        self._in_title = tag == "title" and "svg" not in self.tags[-3:-1]
        attrs = dict(attrs)
        if attrs.get("href"):
            self.hrefs.append(attrs["href"])
        if attrs.get("src"):
            self.srcs.append(attrs["src"])

    def handle_data(self, data) -> None:
        if self._in_title and not self.title:
            self.title = data.strip()

    def handle_endtag(self, tag) -> None:
        self._in_title = False


def _parse(page: Path) -> _Page:
    parser = _Page()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def _conf_pages(site: Path) -> dict[str, Path]:
    """Configuration pages by the draft KV, request count and DCP of the full key each names under its title."""
    out = {}
    for page in (site / "configurations").glob("*.html"):
        m = re.search(r"<code>toy \w+ dcp(\d+) .*kv=(\w+) .* n=(\d+) ", page.read_text())
        out[f"{m[2]} n={m[3]} dcp{m[1]}"] = page
    return out


def test_every_link_resolves_inside_the_site(site):
    pages = sorted(site.rglob("*.html"))
    assert {site / "index.html", site / "regressions.html"} <= set(pages)
    assert len(list((site / "configurations").glob("*.html"))) == 3
    reports = list((site / "runs").glob("*/report.html"))
    assert len(reports) == 2 + 1 + len(SYNTHETIC) - 1  # every night but the one whose folder is gone
    for page in pages:
        parsed = _parse(page)
        assert "script" not in parsed.tags and "link" not in parsed.tags and parsed.srcs == [], page
        for href in parsed.hrefs:
            parts = urlsplit(href)
            assert not parts.scheme and not parts.netloc, (page, href)  # nothing outside the folder
            if not parts.path:
                continue  # a fragment of the page itself
            target = (page.parent / unquote(parts.path)).resolve()
            assert target.is_file() and target.is_relative_to(site.resolve()), (page, href)


def test_each_copied_report_leads_back_to_its_configuration(site):
    mark = json.loads((site / published.MARKER).read_text())
    page_of = {run: c["page"] for c in mark["configurations"] for run in c["runs"]}
    for report in (site / "runs").glob("*/report.html"):
        hrefs = _parse(report).hrefs
        assert hrefs[:2] == [f"../../{page_of[int(report.parent.name)]}", "../../index.html"], report
        assert report.read_text().count("<nav") == 1


def test_series_are_labelled_by_what_a_person_reads(site):
    """Model, DCP, draft KV and drafter name a series; its hashes are in its page's detail, not its name."""
    labels = re.findall(r'<td class="label"><a href="[^"]+">([^<]+)</a>', (site / "index.html").read_text())
    assert labels == ["toy \u00b7 DCP 2 \u00b7 draft KV sharded \u00b7 toy/draft",
                      "toy \u00b7 DCP 2 \u00b7 draft KV replicated \u00b7 toy/draft",
                      "toy \u00b7 DCP 4 \u00b7 draft KV replicated \u00b7 toy/draft"]
    for page in _conf_pages(site).values():
        text = page.read_text()
        assert "sha256:" not in _parse(page).title and "<dt>corpus_fingerprint</dt><dd><code>sha256:" in text


def test_labels_alike_are_told_apart_by_what_differs(tmp_path):
    """Two selections of one corpus (the same model, DCP, draft KV and drafter) are named with what tells them apart."""
    db = tmp_path / "h.sqlite"
    for n in (8, 12):
        res = synthetic_result(n, n_resamples=10)
        res.candidate.config["draft_path"] = "/ckpt/dflash/v3/"
        history.record_run(db, res, None)
    assert sorted(c.label for c in published.build(db).configurations) == [
        "toy \u00b7 DCP 4 \u00b7 draft KV replicated \u00b7 dflash/v3 \u00b7 n_requests 12",
        "toy \u00b7 DCP 4 \u00b7 draft KV replicated \u00b7 dflash/v3 \u00b7 n_requests 8"]


def test_the_index_leads_with_the_failing_configuration(site):
    text = (site / "index.html").read_text()
    pages = _conf_pages(site)
    rows = re.findall(r'<tr class="(pass|fail)">\s*<td class="label"><a href="([^"]+)"', text)
    assert len(rows) == 3
    assert [verdict for verdict, _ in rows] == ["fail", "pass", "pass"]
    assert site / rows[0][1] == pages["sharded n=4 dcp2"]
    assert "1 configuration failed its latest run" in text
    assert "<title>qual runs: 3 configurations, 1 failing</title>" in text
    # the overview: a panel a configuration on one axis, its title leading to the configuration's page
    overview = text.split("<h2>Overview</h2>")[1].split("</figure>")[0]
    for _, page in rows:
        assert overview.count(f'<a href="{page}">') == 1, page


def test_configuration_pages_mark_failed_error_and_upgraded_nights(site, db):
    runs = history.list_runs(db, limit=None)
    synthetic = _conf_pages(site)["replicated n=24 dcp4"]
    text = synthetic.read_text()
    svg = text.split("<h2>Acceptance across nights</h2>")[1].split("</figure>")[0]
    # the failing night: banded and named in both panels, its row marked, its checks named
    assert svg.count(f"fill: none; stroke: {plots.FAIL_BAND}") == 2 and svg.count(">FAIL</text>") == 2
    assert text.count('<tr class="fail"') == 2 and "acceptance_delta_lower_bound" in text  # and the error night's
    # the error night: a grey band in both panels leading to its summary.md, its cause in the runs table
    error = next(r for r in runs if r.is_error)
    assert svg.count(f"fill: none; stroke: {plots.ERROR_BAND}") == 2 and svg.count(">ERROR</text>") == 2
    assert svg.count(f'<a href="../runs/{error.id}/summary.md">') == 2
    assert f"exit 3: {ERROR_CAUSE}" in text and (site / "runs" / str(error.id) / "summary.md").is_file()
    # the engine upgrade: a dashed line named by the new version in both panels
    assert svg.count(f">{UPGRADED}</text>") == 2
    # draft positions numbered as the report numbers them: from 0
    assert ">position 0</text>" in svg and ">position 6</text>" in svg and ">position 7<" not in svg
    for _, _, commit in SYNTHETIC:
        assert f"commit {commit[:7]}" in svg  # in the tooltip of the night's points
        assert f"<code>{commit[:7]}</code>" in text  # in the runs table
    # the night whose folder is gone: no link, a hollow point, said so
    gone = next(r for r in runs if r.created_at.startswith(f"2026-11-{MISSING_DAY}"))
    assert f"run {gone.id}: none" in text  # in the runs table, and why under it
    why = rf"<li>run {gone.id} \([^)]+\): result file \S+synthetic-{MISSING_DAY}/result.json is missing"
    assert re.search(why, text)
    assert f'href="../runs/{gone.id}/' not in text and svg.count(f'<a href="#run-{gone.id}">') == 2  # to its row
    assert f'<tr class="pass" id="run-{gone.id}">' in text and "no report: from the history row only" in svg
    # every other night: its points link to its copied report
    for r in runs:
        if r.created_at.startswith("2026-11") and r.id not in (gone.id, error.id):
            assert text.count(f'href="../runs/{r.id}/report.html"') >= 3  # its points in both panels, the table
    real = _conf_pages(site)["replicated n=4 dcp2"].read_text()
    later = max((r for r in runs if r.n_requests == 4), key=lambda r: r.created_at)
    assert later.qual_commit and f"commit {later.qual_commit[:7]}" in real and f"{later.created_at[:10]} " in real
    assert 'class="fail"' not in real.split("<h2>Runs</h2>")[1] and "<h2>Runs</h2>" in real


def test_the_regressions_page_lists_each_step_with_the_nights_around_it(site, db):
    runs = {r.id: r for r in history.list_runs(db, limit=None)}
    steps = history.detect_step_changes(list(runs.values()))
    text = (site / "regressions.html").read_text()
    assert f"<title>qual runs: {len(steps)} step changes</title>" in text and len(steps) >= 2
    sections = text.split("<h2 ")[1:]
    assert len(sections) == len(steps)
    for step in steps:
        section = next(s for s in sections if s.startswith(f'id="step-{step.run_id}-{step.arm}"'))
        assert f"{step.before * 100:.2f}% &rarr; {step.after * 100:.2f}%" in section
        shown = [int(i) for i in re.findall(r">run (\d+)", section)]
        assert step.previous_run_id in shown and step.run_id in shown and len(shown) >= 3  # and a night around


def test_every_plot_runs_along_the_axis_asked_for(db, tmp_path, capsys):
    out = tmp_path / "by-engine"
    assert run_app(["history", "publish", str(out), "--history", str(db), "--axis", "engine"]) == 0
    assert json.loads((out / published.MARKER).read_text())["axis"] == "engine"
    for page in (out / "index.html", _conf_pages(out)["replicated n=24 dcp4"]):
        svg = page.read_text().split('<div class="plot">')[1]
        # one x axis shared by the panels (labelled once), its columns labelled where the engine changes
        assert svg.count(">engine</text>") == 1 and f">{UPGRADED}</text>" in svg, page
    capsys.readouterr()
    assert run_app(["history", "publish", str(tmp_path / "x"), "--history", str(db), "--axis", "gpu"]) == 2
    assert "--axis 'gpu': expected one of date, engine, qual or meta:KEY" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("threshold", [0.0, 2.5, 50.0])
def test_the_step_threshold_is_an_option_recorded_on_every_page(db, site, tmp_path, threshold):
    """--threshold-pp decides which jumps are step changes (as detect_step_changes counts them at that threshold),
    and the index, each configuration's page, the regressions page and qual-site.json say which threshold it was;
    the default site says 2 pp."""
    out = tmp_path / "pub"
    assert run_app(["history", "publish", str(out), "--history", str(db), "--threshold-pp", str(threshold)]) == 0
    runs = history.list_runs(db, limit=None)
    want = len(history.detect_step_changes(runs, threshold))
    text = (out / "regressions.html").read_text()
    assert f"<title>qual runs: {want} step change{'s' if want != 1 else ''}</title>" in text
    assert f"more than {threshold:g} pp" in text
    for page in (out / "index.html", *_conf_pages(out).values()):
        assert f"more than {threshold:g} pp" in " ".join(page.read_text().split()), page
    assert json.loads((out / published.MARKER).read_text())["threshold_pp"] == threshold
    assert json.loads((site / published.MARKER).read_text())["threshold_pp"] == history.DEFAULT_STEP_PP == 2.0
    assert "more than 2 pp" in " ".join((site / "index.html").read_text().split())


@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "two"])
def test_a_bad_step_threshold_is_one_line_and_exit_2_before_anything_is_written(db, tmp_path, capsys, bad):
    out = tmp_path / "pub"
    assert run_app(["history", "publish", str(out), "--history", str(db), f"--threshold-pp={bad}"]) == 2
    err = capsys.readouterr().err
    assert "--threshold-pp" in err, err
    if bad != "two":  # not a number at all: click's usage error, before qual reads it
        assert err == f"error: --threshold-pp {float(bad)!r}: expected a finite number of percentage points >= 0\n"
    assert not out.exists()


def test_publish_again_replaces_the_site(site, db, capsys):
    before = {p.relative_to(site): p.read_bytes() for p in site.rglob("*") if p.is_file()}
    # a file no publish wrote is never deleted: the publish is refused, naming it, and the folder stays as it was
    (site / "runs" / "notes.txt").write_text("left by hand")
    assert run_app(["history", "publish", str(site), "--history", str(db)]) == 2
    assert capsys.readouterr().err == (f"error: {site} holds runs/notes.txt, which no publish wrote; publishing "
                                       "replaces the folder whole: move it out, or give another folder\n")
    (site / "runs" / "notes.txt").unlink()
    assert {p.relative_to(site): p.read_bytes() for p in site.rglob("*") if p.is_file()} == before
    assert run_app(["history", "publish", str(site), "--history", str(db)]) == 0
    after = {p.relative_to(site): p.read_bytes() for p in site.rglob("*") if p.is_file()}
    assert after == before  # the same bytes, and nothing but what publish writes
    assert [p.name for p in site.parent.iterdir()] == [site.name]  # no temporary folder left beside it


def test_bad_input_is_one_line_and_exit_2(db, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    empty = tmp_path / "empty.sqlite"
    history.record_run(empty, synthetic_result(4, n_resamples=10), None)
    with sqlite3.connect(empty) as conn:
        conn.execute("DELETE FROM runs")
    cases = {
        "nothing to publish": [str(tmp_path / "site"), "--history", str(empty)],
        "exists and is not a folder": [str(a_file), "--history", str(db)],
        "is not a site qual published": [str(tmp_path / "mine"), "--history", str(db)],
        "no run history at": [str(tmp_path / "site"), "--history", str(tmp_path / "none.sqlite")],
        "path component": [str(tmp_path / ("x" * 300)), "--history", str(db)],
    }
    for message, argv in cases.items():
        assert run_app(["history", "publish", *argv]) == 2, message
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "site").exists()


def test_a_result_file_overwritten_by_a_later_run_is_not_this_nights(tmp_path):
    """Two runs written to one --out: the folder holds the later one, so the earlier night links to nothing."""
    db = tmp_path / "h.sqlite"
    first = synthetic_result(12, n_resamples=50, created_at="2026-11-01T02:00:00+00:00")
    second = synthetic_result(12, n_resamples=50, created_at="2026-11-02T02:00:00+00:00")
    history.record_run(db, first, write_reports(first, tmp_path / "run")["json"])
    history.record_run(db, second, write_reports(second, tmp_path / "run")["json"])
    nights = published.build(db).nights
    assert nights[0].report is None and "now holds a run of 2026-11-02" in nights[0].missing
    assert nights[1].report == f"runs/{nights[1].run.id}/report.html"


# ---------------------------------------------------------------- in a browser

# Run in the page: elements reaching past the window (an element inside a box that scrolls is that box's business),
# and what was drawn.
MEASURE = """(() => {
  const view = document.documentElement.clientWidth;
  const boxed = el => {
    for (let p = el.parentElement; p && p !== document.body; p = p.parentElement)
      if (getComputedStyle(p).overflowX !== "visible") return true;
    return false;
  };
  const wide = [];
  for (const el of document.body.querySelectorAll("*")) {
    if (boxed(el)) continue;
    const r = el.getBoundingClientRect();
    if (r.width && (r.right > view + 0.5 || r.left < -0.5)) wide.push(el.tagName + " " + Math.round(r.right));
  }
  return {title: document.title, clientWidth: view, scrollWidth: document.documentElement.scrollWidth, wide: wide,
          svgs: document.querySelectorAll("svg").length,
          svg_links: document.querySelectorAll("svg a").length, rows: document.querySelectorAll("tr").length,
          scrolling: [...document.querySelectorAll(".scroll, .plot")]
            .filter(b => b.scrollWidth > b.clientWidth).length,
          // each plot's box as it opens: how far the plot's left and right ends lie outside the box (px; 0 at an end
          // in view), and how much of it does not fit
          plots: [...document.querySelectorAll(".plot")].map(b => {
            const box = b.getBoundingClientRect(), svg = b.querySelector("svg").getBoundingClientRect();
            return {left_hidden: Math.round(box.left - svg.left), right_hidden: Math.round(svg.right - box.right),
                    overflow: b.scrollWidth - b.clientWidth};
          })};
})()"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_the_site_fits_a_desktop_and_a_phone(site, tmp_path):
    page = _conf_pages(site)["replicated n=24 dcp4"]
    with Browser(CHROMIUM, tmp_path / "chromium-profile") as browser:
        for name, size in VIEWPORTS.items():
            index = browser.open((site / "index.html").as_uri(), *size)
            layout = index.evaluate(MEASURE)
            print(f"\n{name} index: {index.screenshot(tmp_path / f'index-{size[0]}px.png', full_page=True)}")
            assert layout["title"] == "qual runs: 3 configurations, 1 failing"
            assert layout["clientWidth"] == layout["scrollWidth"] == size[0] and layout["wide"] == [], layout
            assert layout["rows"] == 1 + 3 and layout["svgs"] == 1  # the overview
            assert layout["scrolling"] == 0 or name == "phone"  # on a desktop the plot and the table fit whole
            # the overview opens at its newest end: on a phone its older nights lie off to the left, to scroll to
            [plot] = layout["plots"]
            assert plot["right_hidden"] == 0 and plot["left_hidden"] == plot["overflow"], layout["plots"]
            assert (plot["overflow"] > 0) == (name == "phone"), layout["plots"]
            conf = browser.open(page.as_uri(), *size)
            layout = conf.evaluate(MEASURE)
            print(f"{name} configuration page: {conf.screenshot(tmp_path / f'configuration-{size[0]}px.png', True)}")
            assert layout["title"].startswith("qual pass: toy ")
            assert layout["clientWidth"] == layout["scrollWidth"] == size[0] and layout["wide"] == [], layout
            assert layout["scrolling"] == 0 or name == "phone"  # on a desktop the plot and the runs fit whole
            reported, k = len(SYNTHETIC) - 1, 7
            # links: both arms' points and k positions' of each night with a report, the arms' of the night without
            # (to its row), and in each of the two panels the FAIL and the ERROR mark (the failed night's report, the
            # error night's summary)
            assert layout["svgs"] == 1 and layout["svg_links"] == reported * (2 + k) + 2 + 2 * 2, layout
            regressions = browser.open((site / "regressions.html").as_uri(), *size)
            layout = regressions.evaluate(MEASURE)
            print(f"{name} regressions: {regressions.screenshot(tmp_path / f'regressions-{size[0]}px.png', True)}")
            assert layout["clientWidth"] == layout["scrollWidth"] == size[0] and layout["wide"] == [], layout


_KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from qual.report import site

real = os.replace
def replace(source, target):  # the earlier site moved aside, the new one not yet in its place: killed there
    real(source, target)
    if os.path.basename(target) == "site" and ".old-" in os.path.basename(os.path.dirname(target)):
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
site.publish(sys.argv[1], sys.argv[2])
"""


def test_a_publish_killed_midway_leaves_nothing_the_next_one_does_not_clear(tmp_path, capsys):
    """A publish killed with SIGKILL between moving the earlier site aside and moving the new one in leaves both hidden
    folders beside the site and no site: the next publish puts the earlier site back (so a publish that then fails
    loses nothing) and removes both; a folder a running publish holds (qual.files.locked_folder) is left to it."""
    from qual.files import locked_folder

    db = tmp_path / "h.sqlite"
    for day in (1, 2):
        history.record_run(db, synthetic_result(8, n_resamples=20, created_at=f"2026-12-0{day}T02:00:00+00:00"), None)
    out = tmp_path / "pub" / "site"
    published.publish(db, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = subprocess.run([sys.executable, "-c", _KILLED_BETWEEN_RENAMES, str(db), str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    left = sorted(p.name for p in out.parent.iterdir())
    assert not out.exists() and [re.sub(r"-[a-z0-9_]{8}$", "-*", n) for n in left] == [".site.old-*",
                                                                                    ".site.publish-*"]
    running, lock = locked_folder(out.parent, ".site.publish-", "publish")  # as a publish running now holds its own
    assert run_app(["history", "publish", str(out), "--history", str(tmp_path / "none.sqlite")]) == 2
    assert "no run history at" in capsys.readouterr().err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # put back
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, running.name])
    assert run_app(["history", "publish", str(out), "--history", str(db)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, running.name])
    lock.release()  # its maker gone without removing it: the next publish does
    assert run_app(["history", "publish", str(out), "--history", str(db)]) == 0
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
