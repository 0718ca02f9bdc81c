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
    assert "--speedup" in r["reproduce"]
    assert "speedup \u00d7" in proc.stdout and "(measured on a CPU: noisy)" in proc.stdout
    summary, report = (out / "summary.md").read_text(), (out / "report.html").read_text()
    assert "### Latency" in summary and "| | control | candidate | plain |" in summary and "Speedup \u00d7" in summary
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
