"""Sweeps (`qual run --dcp 2,4 --draft-kv replicated,sharded`): the options, the plan's arms, a sweep end to end on the
toy pair (the control once, a verdict per candidate, the worst as the exit code, one history row per comparison), its
readers (`qual compare`, `--baseline`), and a sweep killed during its second candidate and resumed.

The same runs show that the harness catches the regression it exists for, on the trained toy pair (CPU, gloo, DCP 4):
the single `qual run --dcp 4 --draft-kv sharded` fails its gate, and the sweep's DCP-4 replicated candidate, which is
that single run number for number (test_a_sweeps_comparison_is_the_single_run_of_its_candidate), equals DCP 1."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoints import make_profile
from cli_inprocess import qual_in
from nic_env import nic_env
from qual.errors import QualError
from qual.harness.journal import read_journal
from qual.harness.plan import RunOptions, make_plan, run_options
from qual.proc import alive, descendants

QUAL = [sys.executable, "-m", "qual"]
SWEEP = ["--dcp", "2,4", "--draft-kv", "replicated,sharded"]
NAMES = ["candidate-dcp2-replicated", "candidate-dcp2-sharded", "candidate-dcp4-replicated", "candidate-dcp4-sharded"]
# the first HumanEval prompts: sharded draft KV falls ~49% -> 19% (DCP 2) and 5% (DCP 4), far past the gate's bounds
LIMIT = 4


def qual(*args, timeout=600):
    return subprocess.run([*QUAL, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def errors(db: Path) -> list[tuple]:
    """(run_id, dcp, tp, draft_kv, outcome, exit_code) of each row."""
    with sqlite3.connect(db) as c:
        return c.execute("SELECT run_id, dcp, tp, draft_kv, outcome, exit_code FROM runs ORDER BY id").fetchall()


def rows(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT run_id, dcp, tp, draft_kv, verdict, configuration, result_path FROM runs ORDER BY id").fetchall()


# ---------------------------------------------------------------- options and plan (no engine runs)


def test_a_comma_list_is_a_sweep_and_one_value_is_a_run_as_always():
    one = run_options(dcp="4", draft_kv="sharded")
    assert (one.dcp, one.draft_kv) == (4, "sharded")  # run.json keeps today's scalars
    assert one.command() == run_options(dcp=4, draft_kv="sharded").command()
    many = run_options(dcp="2,4", draft_kv="replicated,sharded")
    assert (many.dcp, many.draft_kv) == ((2, 4), ("replicated", "sharded"))
    assert "--dcp 2,4 --draft-kv replicated,sharded" in many.command()
    assert RunOptions(dcp=[2, 4], draft_kv=["replicated", "sharded"]) == many  # from run.json's lists


@pytest.mark.parametrize("flags, words", [
    ({"dcp": "2,abc"}, "--dcp: input should be a valid integer"),
    ({"dcp": "abc"}, "--dcp: input should be a valid integer (got 'abc')"),
    ({"dcp": "2,0"}, "--dcp: input should be greater than or equal to 1"),
    ({"dcp": "4,4"}, "--dcp: a value is listed twice"),
    ({"draft_kv": "replicated,bogus"}, "--draft-kv: input should be 'replicated' or 'sharded'"),
    ({"dsa_topk": "exact,exact"}, "--dsa-topk: a value is listed twice"),
])
def test_bad_lists_are_refused_naming_the_flag(flags, words):
    with pytest.raises(QualError) as exc:
        run_options(**flags)
    assert words in str(exc.value)


def test_a_list_of_one_in_run_json_is_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="two or more"):
        RunOptions(dcp=[4])


def test_the_plan_runs_the_control_once_at_the_largest_tp():
    plan = make_plan(run_options(dcp="2,4", draft_kv="replicated,sharded", limit=2), dry_run=True)
    assert plan.is_sweep and plan.candidates == NAMES
    layout = {name: (a.dcp, a.tp, a.draft_kv) for name, a in plan.arms.items()}
    assert layout == {"control": (1, 4, "replicated"), NAMES[0]: (2, 2, "replicated"), NAMES[1]: (2, 2, "sharded"),
                      NAMES[2]: (4, 4, "replicated"), NAMES[3]: (4, 4, "sharded")}
    held = make_plan(run_options(dcp="2,4", tp=4, limit=2), dry_run=True)  # --tp holds TP across the sweep
    assert {a.tp for a in held.arms.values()} == {4} and held.candidates == ["candidate-dcp2", "candidate-dcp4"]
    single = make_plan(run_options(dcp="4", limit=2), dry_run=True)
    assert list(single.arms) == ["control", "candidate"] and not single.is_sweep


@pytest.mark.parametrize("flags, words", [
    ({"baseline": "history:last-pass"}, "--baseline with a sweep (--dcp 2,4)"),
    ({"engine": "attach", "control_url": "http://127.0.0.1:1", "candidate_url": "http://127.0.0.1:2"},
     "--dcp 2,4: a sweep runs one candidate per value; --engine attach attaches to one running candidate server"),
    ({"tp": 3}, "tp=3 is not divisible by dcp=2"),
])
def test_what_a_sweep_cannot_do_is_refused_by_name(flags, words):
    with pytest.raises(QualError) as exc:
        make_plan(run_options(dcp="2,4", limit=2, **flags), dry_run=True)
    assert words in str(exc.value)


# ---------------------------------------------------------------- the toy pair, end to end


@pytest.fixture(scope="module")
def toy_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    out, db = root / "out", root / "h.sqlite"
    t0 = time.monotonic()
    proc = qual("run", *SWEEP, "--limit", LIMIT, "--out", out, "--history", db)
    print(f"\nsweep of 4 candidates, {LIMIT} requests: {time.monotonic() - t0:.1f} s")
    return proc, out, db


@pytest.mark.slow
def test_a_sweep_fails_the_sharded_candidates_and_runs_the_control_once(toy_sweep):
    proc, out, db = toy_sweep
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the worst candidate's verdict
    result = json.loads((out / "result.json").read_text())
    assert result["schema"] == "qual.result.sweep/1" and result["passed"] is False
    verdicts = {c["name"]: c["gate"]["passed"] for c in result["comparisons"]}
    assert verdicts == {NAMES[0]: True, NAMES[1]: False, NAMES[2]: True, NAMES[3]: False}
    control = result["control"]
    assert control["config"]["dcp"] == 1 and control["config"]["tp"] == 4 and "arms" not in result
    assert control["extra"]["requests_run"] == LIMIT and control["throughput"]["wall_seconds"] > 0
    journals = sorted(p.name for p in out.glob("*.requests.jsonl"))
    assert journals == sorted(["control.requests.jsonl", *(f"{n}.requests.jsonl" for n in NAMES)])
    assert len(read_journal(out / "control.requests.jsonl")) == LIMIT
    for c in result["comparisons"]:
        assert c["comparison"]["target_outputs_identical"] is True
        replicated = c["candidate"]["config"]["draft_kv"] == "replicated"
        assert (c["comparison"]["delta_rate"] == 0) == replicated
    assert "PASS candidate-dcp2-replicated" in proc.stdout and "FAIL candidate-dcp4-sharded" in proc.stdout
    assert proc.stdout.startswith("FAIL: 2/4 candidates passed")
    assert "differ from it in TP too" in proc.stderr and result["notes"]


@pytest.mark.slow
def test_one_history_row_per_comparison_keyed_by_its_candidate(toy_sweep, capsys):
    from qual.configuration import ConfigurationKey
    from qual.sweep_result import load_any

    _, out, db = toy_sweep
    recorded = rows(db)
    assert [(r[1], r[2], r[3], r[4]) for r in recorded] == [(2, 2, "replicated", "pass"), (2, 2, "sharded", "fail"),
                                                          (4, 4, "replicated", "pass"), (4, 4, "sharded", "fail")]
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert [r[0] for r in recorded] == [f"{run_id}/{n}" for n in NAMES]
    sweep = load_any(out / "result.json")
    assert [r[5] for r in recorded] == [ConfigurationKey.of_result(sweep.result(n)).key() for n in NAMES]
    assert {r[6] for r in recorded} == {str(out / "result.json")}
    again = qual_in(capsys, "run", "--resume", out)  # a finished sweep resumed: nothing runs, no row is added
    assert again.returncode == 1, again.stderr
    assert "starting" not in again.stderr and len(rows(db)) == 4


def test_a_sweep_is_published_as_one_configuration_per_candidate(toy_sweep, tmp_path, capsys):
    """`qual history publish` reads each comparison of a sweep's result.json for its own row."""
    _, out, db = toy_sweep
    site = tmp_path / "site"
    proc = qual_in(capsys, "history", "publish", site, "--history", db)
    assert proc.returncode == 0, proc.stderr
    assert "published 4 configurations, 4 runs (4 with their report)" in proc.stdout
    data = json.loads((site / "qual-site.json").read_text())
    assert "missing" not in json.dumps(data), data


@pytest.mark.slow
def test_the_reports_hold_a_matrix_and_each_candidates_detail(toy_sweep):
    import xml.etree.ElementTree as ET

    _, out, _ = toy_sweep
    html = (out / "report.html").read_text()
    assert html.count('<section class="candidate"') == 4 and 'id="matrix"' in html
    for name in NAMES:
        assert f'href="#{name}"' in html and f'id="{name}"' in html and f'id="{name}-headline"' in html
    summary = (out / "summary.md").read_text()
    assert summary.startswith("## ❌ FAIL") and summary.count("| `candidate-dcp") == 4
    suites = ET.parse(out / "junit.xml").getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == [f"qual.gate.toy.{n.removeprefix('candidate-')}" for n in NAMES]
    assert [int(s.get("failures")) > 0 for s in suites] == [False, True, False, True]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The single run of the sweep's last candidate: the legacy sharded draft KV at DCP 4."""
    root = tmp_path_factory.mktemp("sharded")
    proc = qual("run", "--dcp", 4, "--draft-kv", "sharded", "--limit", LIMIT, "--out", root / "out", "--history",
                root / "h.sqlite")
    return proc, root / "out"


@pytest.mark.slow
def test_replicated_draft_kv_passes_and_equals_dcp1(toy_sweep):
    _, out, _ = toy_sweep
    result = json.loads((out / "result.json").read_text())
    (c,) = [c for c in result["comparisons"] if c["name"] == NAMES[2]]
    assert c["gate"]["passed"]
    ctrl, cand = result["control"]["acceptance"], c["candidate"]["acceptance"]
    assert ctrl["rate"] == cand["rate"] and ctrl["per_position"] == cand["per_position"]
    assert c["comparison"]["proposal_divergence"]["overall"] == 0
    assert ctrl["rate"] >= 0.25  # the toy pair drafts for real


@pytest.mark.slow
def test_legacy_sharded_draft_kv_fails_the_gate_and_the_report_shows_where(sharded):
    proc, out = sharded
    assert proc.returncode == 1, proc.stdout + proc.stderr
    r = json.loads((out / "result.json").read_text())
    ctrl, cand = r["arms"]["control"]["acceptance"], r["arms"]["candidate"]["acceptance"]
    assert ctrl["rate"] - cand["rate"] >= 0.05  # at least 5 pp lower
    assert r["comparison"]["target_outputs_identical"] is True  # output stays valid: the target verifies everything
    assert r["comparison"]["proposal_divergence"]["overall"] > 0
    failed = {c["name"] for c in r["gate"]["checks"] if not c["passed"]}
    assert "acceptance_delta_lower_bound" in failed
    html = (out / "report.html").read_text()
    assert "FAIL" in html.upper() and "acceptance_delta_lower_bound" in html
    junit = (out / "junit.xml").read_text()
    assert "<failure" in junit


@pytest.mark.slow
def test_a_sweeps_comparison_is_the_single_run_of_its_candidate(toy_sweep, sharded):
    """The control runs at TP 4, the DCP-4 candidates' own: their comparisons are the single runs', number for number
    (the control arm is the same configuration in the sweep and in the single run)."""
    _, out, _ = toy_sweep
    proc, one = sharded
    assert proc.returncode == 1, proc.stderr
    single = json.loads((one / "result.json").read_text())
    sweep = json.loads((out / "result.json").read_text())
    (cmp,) = [c for c in sweep["comparisons"] if c["name"] == NAMES[3]]
    assert cmp["comparison"] == single["comparison"] and cmp["gate"]["checks"] == single["gate"]["checks"]
    untimed = lambda records: [{k: v for k, v in r.items() if k != "latency"} for r in records]  # noqa: E731
    assert untimed(sweep["control"]["per_request"]) == untimed(single["arms"]["control"]["per_request"])
    assert untimed(cmp["candidate"]["per_request"]) == untimed(single["arms"]["candidate"]["per_request"])
    assert sweep["control"]["acceptance"] == single["arms"]["control"]["acceptance"]
    assert cmp["candidate"]["acceptance"] == single["arms"]["candidate"]["acceptance"]


@pytest.mark.slow
def test_compare_and_baseline_read_a_sweeps_result(toy_sweep, tmp_path, capsys):
    from qual.harness.baseline import resolve

    _, out, db = toy_sweep
    proc = qual_in(capsys, "compare", f"{out}:control", f"{out}:{NAMES[3]}", "--out", tmp_path / "c")
    assert proc.returncode == 1 and "acceptance_delta_lower_bound" in proc.stdout, proc.stderr
    proc = qual_in(capsys, "compare", f"{out}:control", str(out), "--out", tmp_path / "d")  # the default arm, candidate: no such arm
    assert proc.returncode == 2 and f"has the arms control, {', '.join(NAMES)}" in proc.stderr
    # --baseline: a history row of a sweep serves with its own comparison; a result file with this run's
    plan = make_plan(run_options(dcp="2", draft_kv="sharded", limit=LIMIT, history=str(db)), dry_run=True)
    found = resolve(str(out), db, plan.configuration)
    assert (found.result.candidate.config["dcp"], found.result.candidate.config["draft_kv"]) == (2, "sharded")
    found = resolve("history:last-pass", db, make_plan(run_options(dcp="4", limit=LIMIT), dry_run=True).configuration)
    assert found.history_id == 3 and found.result.candidate.config["dcp"] == 4
    with pytest.raises(QualError, match="none of its candidates"):
        resolve(str(out), db, make_plan(run_options(dcp="1", limit=LIMIT), dry_run=True).configuration)


# ---------------------------------------------------------------- a sweep killed in its second candidate, resumed


@pytest.mark.slow
def test_a_sweep_killed_in_its_second_candidate_resumes_only_what_is_missing(tmp_path):
    profile = make_profile(tmp_path / "prof", reference={"max_num_seqs": 1})
    # enough requests that the kill, sent once the second candidate's first result is journaled, lands among them
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"q{i:02d}", "prompt": f"def f{i}(x):\n    return x * {i}",
                                          "max_tokens": 6}) + "\n" for i in range(8)))
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    names = ["candidate-dcp1", "candidate-dcp2"]
    second = out / f"{names[1]}.requests.jsonl"
    proc = subprocess.Popen([*QUAL, "run", "--model", str(profile), "--dcp", "1,2", "--corpus", str(corpus), "--out",
                             str(out), "--history", str(db)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=nic_env(), start_new_session=True)
    deadline = time.monotonic() + 240
    while not (second.exists() and second.read_text().count("\n") >= 1):
        assert proc.poll() is None, f"the sweep ended (exit {proc.returncode}) before its second candidate's first result"
        assert time.monotonic() < deadline, "no result of the second candidate within 240 s"
        time.sleep(0.02)
    tree = [proc.pid, *descendants(proc.pid)]
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=10) == 130, proc.stderr.read()[-2000:]
    deadline = time.monotonic() + 3.0
    while [p for p in tree if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in tree if alive(p)] == []
    assert not (out / "result.json").exists()
    # the interrupted night left a row per comparison, an error row each (exit 130), and summary.md saying why
    assert [r[4:6] for r in errors(db)] == [("error", 130)] * len(names)
    assert (out / "summary.md").read_text().startswith("## ⛔ ERROR")
    total = json.loads((out / "run.json").read_text())["corpus"]["count"]
    done = len(read_journal(second))
    assert 1 <= done < total, "the kill landed outside the second candidate's requests"
    finished = {p.name: p.read_bytes() for p in out.iterdir()
                if p.name.startswith(("control.", f"{names[0]}."))}  # journals and arm records of the arms that finished
    assert sorted(finished) == sorted(f"{arm}.{kind}" for arm in ("control", names[0])
                                      for kind in ("arm.json", "requests.jsonl"))

    resumed = subprocess.run([*QUAL, "run", "--resume", str(out)], capture_output=True, text=True, env=nic_env(),
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    for name, data in finished.items():  # not one of their requests ran again: the files are as the kill left them
        assert (out / name).read_bytes() == data, name
    info = json.loads((out / f"{names[1]}.arm.json").read_text())
    assert info["extra"]["resumed_with"] == done and info["extra"]["requests_run"] == total - done
    ids = [json.loads(line)["id"] for line in second.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == total
    result = json.loads((out / "result.json").read_text())
    assert [c["name"] for c in result["comparisons"]] == names and result["passed"] is True
    assert [r[0].rpartition("/")[2] for r in rows(db)] == names
    assert [r[4:6] for r in errors(db)] == [("pass", 0)] * len(names)  # the real rows replaced the error rows
