"""`qual run --speedup` end to end on tiny checkpoints: the candidate's configuration without the drafter runs as a
third arm, journaled (resumable), and result.json, the report and the summary say what speculation bought."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from checkpoints import make_profile
from cli_inprocess import qual_in
from latency_checks import assert_latency_consistent
from qual.records import RequestResult

pytestmark = pytest.mark.slow  # whole runs

LIMIT = 4


def qual(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "qual", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return make_profile(tmp_path_factory.mktemp("prof"), reference={"max_num_seqs": 2})


@pytest.fixture(scope="module")
def speedup_run(profile, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    proc = qual("run", "--model", profile, "--dcp", 1, "--tp", 1, "--limit", LIMIT, "--speedup", "--out",
                root / "out", "--history", root / "h.sqlite")
    return proc, root / "out"


def test_the_plain_arm_runs_beside_the_two_and_the_speedup_is_recorded(speedup_run):
    proc, out = speedup_run
    assert proc.returncode == 0, proc.stderr
    r = json.loads((out / "result.json").read_text())
    assert set(r["arms"]) == {"control", "candidate"}  # the comparison the gate judges is unchanged
    s = r["speedup"]
    plain, candidate = s["plain"], r["arms"]["candidate"]
    assert plain["config"]["draft_path"] is None and plain["config"]["num_speculative_tokens"] == 0
    assert {k: v for k, v in plain["config"].items() if k not in ("draft_path", "num_speculative_tokens")} == \
        {k: v for k, v in candidate["config"].items() if k not in ("draft_path", "num_speculative_tokens")}
    assert plain["acceptance"]["drafts"] == 0 and plain["latency"]["decode_steps"] > 0
    assert [q["id"] for q in plain["per_request"]] == [q["id"] for q in candidate["per_request"]]
    assert s["target_outputs_identical"] is True  # greedy speculative decoding is lossless
    assert s["n_requests"] == LIMIT and s["bootstrap"]["resamples"] == 2000
    rates = s["decode_tokens_per_second"]
    assert s["ratio"] == pytest.approx(rates["speculative"] / rates["plain"])
    assert rates["speculative"] == candidate["latency"]["decode_tokens_per_second"]
    assert rates["plain"] == plain["latency"]["decode_tokens_per_second"]
    lo, hi = s["ratio_ci95"]
    assert lo <= s["ratio"] <= hi
    steps = s["step_s"]
    assert steps == {"speculative": candidate["latency"]["step_s"], "plain": plain["latency"]["step_s"]}
    assert s["bound"] == pytest.approx(candidate["acceptance"]["mean_acceptance_length"] * steps["plain"] /
                                       steps["speculative"])
    for arm in (r["arms"]["control"], candidate, plain):
        for q in arm["per_request"]:
            assert_latency_consistent(RequestResult.from_json(q))
        assert arm["latency"]["ttft_s"]["n"] == LIMIT and arm["latency"]["percentile_method"] == "linear"
    batch = s["generate_tokens_per_second"]
    assert s["batch_ratio"] == pytest.approx(batch["speculative"] / batch["plain"])
    assert s["directions_agree"] == ((s["ratio"] >= 1) == (s["batch_ratio"] >= 1))
    assert "--speedup" in r["reproduce"]
    assert "speedup per request \u00d7" in proc.stdout and "(measured on a CPU: noisy)" in proc.stdout
    assert "batch throughput \u00d7" in proc.stdout
    summary, report = (out / "summary.md").read_text(), (out / "report.html").read_text()
    assert "### Latency" in summary and "| | control | candidate | plain |" in summary
    assert summary.index("Speedup per request \u00d7") < summary.index("Batch throughput \u00d7") < \
        summary.index("### Gate checks")  # said under the headline, not only in the latency section
    assert "Measured on a CPU" in summary
    assert "Latency and speedup" in report and "time to first token (p50 / p90 / p99)" in report
    assert "Measured on a CPU" in report
    run = json.loads((out / "run.json").read_text())
    assert set(run["arms"]) == {"control", "candidate", "plain"} and run["options"]["speedup"] is True


def test_resume_finishes_the_plain_arm_from_its_journal(speedup_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(speedup_run[1], out)
    journal = out / "plain.requests.jsonl"
    kept = journal.read_text().splitlines()[:2]
    journal.write_text("\n".join(kept) + "\n")
    for name in ("plain.arm.json", "result.json", "report.html", "summary.md"):
        (out / name).unlink()
    resumed = qual("run", "--resume", out)
    assert resumed.returncode == 0, resumed.stderr
    lines = journal.read_text().splitlines()
    assert lines[:2] == kept and len(lines) == LIMIT  # the two journaled requests did not run again
    r = json.loads((out / "result.json").read_text())
    by_id = {q["id"]: q for q in r["speedup"]["plain"]["per_request"]}
    records = [{k: v for k, v in json.loads(line).items() if k != "sealed"} for line in kept]  # a line's digest aside
    assert [by_id[r["id"]] for r in records] == records
    assert json.loads((out / "plain.arm.json").read_text())["extra"]["resumed_with"] == 2


def test_speedup_is_refused_where_it_cannot_run(profile, tmp_path, capsys):
    attach = qual_in(capsys, "run", "--control-url", "http://127.0.0.1:9", "--candidate-url", "http://127.0.0.1:9",
                     "--speedup", "--dry-run")
    assert attach.returncode == 2 and "--speedup runs the candidate's configuration without its drafter" in attach.stderr
    plain = yaml.safe_load(profile.read_text())
    del plain["draft"]
    path = tmp_path / "no-draft.yaml"
    path.write_text(yaml.safe_dump(plain))
    proc = qual_in(capsys, "run", "--model", path, "--dcp", 1, "--speedup", "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert "has no drafter" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_the_per_request_and_batch_ratios_are_both_said_and_a_disagreement_flagged(tmp_path):
    """A run whose requests each decode faster with the drafter (x1.27) while the batch finishes slower (15.6 -> 13.9
    tok/s, x0.89): stdout, summary.md and report.html's first screen say both, that the bound applies to the
    per-request ratio, and that the two disagree."""
    from dataclasses import replace

    from markupsafe import escape

    from qual.report import html, markdown
    from qual.report.latency import speedup_lines
    from qual.result import Speedup
    from synthetic import synthetic_result

    result = synthetic_result(6, 0.75, 0.75)
    speedup = Speedup(plain=replace(result.candidate), decode_tokens_per_second={"speculative": 20.3, "plain": 16.0},
                      ratio=1.27, ratio_ci95=[1.1, 1.45], n_requests=6, mean_acceptance_length=4.36,
                      step_s={"speculative": 0.0152, "plain": 0.0051}, bound=1.46,
                      generate_tokens_per_second={"speculative": 13.9, "plain": 15.6}, target_outputs_identical=True,
                      batch_ratio=13.9 / 15.6, directions_agree=False)
    result = replace(result, speedup=speedup)
    lines = speedup_lines(result)
    assert lines[0].startswith("speedup per request \u00d71.27 (95% CI \u00d71.10\u2013\u00d71.45, 6 requests): "
                               "decode 20.3 tok/s speculative vs 16.0 plain") and "applies to this ratio" in lines[0]
    assert lines[1].startswith("batch throughput \u00d70.89: 13.9 tok/s speculative vs 15.6 plain")
    assert lines[2].startswith("the two disagree: each request decodes faster with speculation, the batch runs slower")
    summary = markdown.render(result)
    assert summary.index("- ⚠️ The two disagree") < summary.index("### Gate checks")
    page = html.render(result)
    first_screen = page[page.index('<section class="verdict'):page.index("</section>")]
    assert all(str(escape(line[1:])) in first_screen for line in lines)
    assert len(speedup_lines(replace(result, speedup=replace(speedup, batch_ratio=1.05, directions_agree=True)))) == 2


def test_the_batch_ratio_and_its_agreement_are_computed_from_the_arms():
    from dataclasses import replace

    from qual.harness.speedup import speedup
    from synthetic import synthetic_result

    result = synthetic_result(6, 0.75, 0.75)
    fast, slow = (replace(result.candidate, throughput=replace(result.candidate.throughput, generate_seconds=g))
                  for g in (1.0, 2.0))
    s = speedup(fast, slow)
    assert s.batch_ratio == pytest.approx(2.0) and s.generate_tokens_per_second["speculative"] == pytest.approx(
        2 * s.generate_tokens_per_second["plain"])
    assert s.directions_agree is ((s.ratio >= 1) == (s.batch_ratio >= 1)) if s.ratio is not None else \
        s.directions_agree is None
