"""`qual run` end to end on tiny checkpoints: exit codes, bad input, resume, matched replay, escaping."""

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
from cli_inprocess import qual_in as cli
from qual import history
from qual.harness.inputs import seal
from qual.harness.journal import sealed

pytestmark = pytest.mark.slow  # engine processes and whole runs: scheduled first (tests/conftest.py)

QUAL = [sys.executable, "-m", "qual"]
# The smoke corpus's first five requests: the fifth is the hostile one (HTML to escape); the three after it only make
# each run and the resumed one longer (each request is decoded alone: max_num_seqs 1).
LIMIT = 5


def qual(*args, timeout=300):
    return subprocess.run([*QUAL, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def history_rows(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db) as c:
        return c.execute("select count(*) from runs").fetchone()[0]


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return make_profile(tmp_path_factory.mktemp("prof"), reference={"max_num_seqs": 1})


@pytest.fixture(scope="module")
def finished_run(profile, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    proc = qual("run", "--model", profile, "--dcp", 2, "--limit", LIMIT, "--out", root / "out",
                "--history", root / "h.sqlite")
    return proc, root


def test_run_passes_and_writes_everything(finished_run):
    proc, root = finished_run
    assert proc.returncode == 0, proc.stderr
    out = root / "out"
    for name in ("result.json", "report.html", "summary.md", "junit.xml", "run.json"):
        assert (out / name).is_file()
    result = json.loads((out / "result.json").read_text())
    assert result["schema"] == "qual.result/1"
    assert result["arms"]["control"]["config"]["dcp"] == 1 and result["arms"]["candidate"]["config"]["dcp"] == 2
    assert result["arms"]["control"]["config"]["tp"] == result["arms"]["candidate"]["config"]["tp"] == 2
    assert result["gate"]["passed"] is True and result["comparison"]["target_outputs_identical"] is True
    assert history_rows(root / "h.sqlite") == 1


def test_hostile_corpus_text_is_escaped(finished_run, tmp_path):
    _, root = finished_run
    html = (root / "out" / "report.html").read_text()
    assert "<script>alert" not in html and "</textarea><" not in html


BAD_CORPORA = {
    "malformed": ('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": \n', ":2:"),
    "missing": ('{"id": "a"}\n', ":1:"),
    "duplicate": ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "duplicate"),
    "empty": ("", "empty"),
}


@pytest.mark.parametrize("kind", sorted(BAD_CORPORA))
def test_bad_corpus_is_exit_2_one_line_and_no_history(profile, tmp_path, capsys, kind):
    text, needle = BAD_CORPORA[kind]
    corpus = tmp_path / f"{kind}.jsonl"
    corpus.write_text(text)
    db = tmp_path / "h.sqlite"
    proc = cli(capsys, "run", "--model", profile, "--dcp", 2, "--corpus", corpus, "--out", tmp_path / "o", "--history", db)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists() and history_rows(db) == 0


@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-model"], "unknown model"),
    (["--dcp", 4, "--tp", 2], "tp % dcp"),
    (["--dcp", 3], "not divisible by tp=3"),
    (["--tp", 0], "--tp: input should be greater than or equal to 1"),  # 0 once fell through to the default and ran
    (["--draft-kv", "halved"], "--draft-kv"),
    (["--engine", "magic"], "--engine"),
    (["--limit", "abc"], "Invalid value for '--limit'"),  # typer >= 0.29 raises its own copy of click's errors
    (["--no-such-flag"], "No such option"),
    (["--axis", "gpu"], "--axis 'gpu': expected one of date, engine, qual or meta:KEY"),  # as `history trend`'s
    (["--axis", "engine"], "--axis engine without --baseline: it says what the report's strip"),  # no strip to draw
    (["--baseline-any"], "--baseline-any without --baseline"),
])
def test_bad_options_are_exit_2(profile, tmp_path, capsys, args, needle):
    if "--model" not in args:
        args = ["--model", profile, *args]
    proc = cli(capsys, "run", *args, "--out", tmp_path / "o", "--history", tmp_path / "h.sqlite")
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert history_rows(tmp_path / "h.sqlite") == 0 and not (tmp_path / "o").exists()  # refused before any work


def test_unwritable_out_or_history_is_exit_2_before_any_work(profile, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, history, needle in [(blocker / "o", tmp_path / "h.sqlite", "--out"),
                                 (tmp_path / "o", tmp_path, "is a directory")]:
        proc = cli(capsys, "run", "--model", profile, "--out", out, "--history", history)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not (tmp_path / "o").exists() and history_rows(tmp_path / "h.sqlite") == 0


def test_missing_vllm_interpreter_is_exit_2_before_any_work(tmp_path, capsys):
    profile = make_profile(tmp_path, vllm={"python": str(tmp_path / "no-venv" / "bin" / "python")})
    proc = cli(capsys, "run", "--model", profile, "--engine", "vllm", "--out", tmp_path / "o", "--history", tmp_path / "h.sqlite")
    assert proc.returncode == 2 and "no such interpreter" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_resume_after_kill_loses_and_repeats_nothing(profile, finished_run, tmp_path, capsys):
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    proc = subprocess.Popen([*QUAL, "run", "--model", str(profile), "--dcp", "2", "--limit", str(LIMIT),
                             "--out", str(out), "--history", str(db)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    journal = out / "control.requests.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not journal.exists() or len(journal.read_text().splitlines()) < 3):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its rank processes, mid-arm
    proc.wait()
    killed_with = len(journal.read_text().splitlines())
    assert 3 <= killed_with < LIMIT and not (out / "result.json").exists() and history_rows(db) == 0
    resumed = qual("run", "--resume", out)
    assert resumed.returncode == 0, resumed.stderr
    for arm in ("control", "candidate"):
        ids = [json.loads(line)["id"] for line in (out / f"{arm}.requests.jsonl").read_text().splitlines()]
        assert len(ids) == len(set(ids)) == LIMIT  # nothing lost, nothing twice
    info = json.loads((out / "control.arm.json").read_text())
    assert info["extra"]["requests_run"] == LIMIT - killed_with
    decode = info["extra"]["decode"]  # the CPU decodes step by step
    assert decode == {"async": False, "steps_ahead": 0, "rows_retired": 0, "steps_per_launch": 1,
                      "launches": {"1": decode["launches"]["1"]}} and decode["launches"]["1"] > 0
    # resumed results equal an uninterrupted run's
    full = json.loads((finished_run[1] / "out" / "result.json").read_text())
    got = json.loads((out / "result.json").read_text())
    for arm in ("control", "candidate"):
        assert [r["output_token_ids"] for r in got["arms"][arm]["per_request"]] == \
               [r["output_token_ids"] for r in full["arms"][arm]["per_request"]]
        t = got["arms"][arm]["throughput"]  # the control arm's time adds up over its two pieces
        assert 0 < t["generate_seconds"] < t["wall_seconds"]
    assert history_rows(db) == 1
    again = cli(capsys, "run", "--resume", out)  # a finished run, resumed (nothing runs): the same run, recorded once
    assert again.returncode == 0, again.stderr
    assert history_rows(db) == 1
    with sqlite3.connect(db) as c:
        assert c.execute("select run_id from runs").fetchall() == [(json.loads((out / "run.json").read_text())["run_id"],)]


def test_matched_replay_is_verified(finished_run, tmp_path, capsys):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(finished_run[1] / "out", out)
    journal = out / "candidate.requests.jsonl"
    lines = journal.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["prompt_token_ids"] = rec["prompt_token_ids"][:-1]
    journal.write_text("\n".join([json.dumps(sealed(rec)), *lines[1:]]) + "\n")  # resealed: past the digest
    proc = cli(capsys, "run", "--resume", out)
    assert proc.returncode == 2 and "journaled with another prompt" in proc.stderr


def test_dry_run_changes_nothing(profile, tmp_path, capsys):
    proc = cli(capsys, "run", "--model", profile, "--dcp", 2, "--dry-run", "--out", tmp_path / "o", "--history", tmp_path / "h.sqlite")
    assert proc.returncode == 0 and "control:" in proc.stdout and "candidate:" in proc.stdout
    assert not (tmp_path / "o").exists() and not (tmp_path / "h.sqlite").exists()


def test_compare_two_arms_and_refuse_unmatched(finished_run, tmp_path, capsys):
    result = finished_run[1] / "out" / "result.json"
    ok = cli(capsys, "compare", f"{result}:control", result, "--out", tmp_path / "cmp")
    assert ok.returncode == 0, ok.stderr
    for name in ("result.json", "report.html", "summary.md", "junit.xml"):
        assert (tmp_path / "cmp" / name).is_file()
    data = json.loads(result.read_text())
    for what, change in [("corpus fingerprints differ", lambda d: d["corpus"].update(fingerprint="sha256:00")),
                         ("sampling differs", lambda d: d["arms"]["candidate"]["config"]["sampling"].update(temperature=0.5))]:
        other = json.loads(json.dumps(data))
        change(other)
        path = tmp_path / "other.json"
        path.write_text(json.dumps(other))
        bad = cli(capsys, "compare", f"{result}:control", path, "--out", tmp_path / "bad")
        assert bad.returncode == 2 and what in bad.stderr and not (tmp_path / "bad").exists()
    (tmp_path / "a-file").write_text("")
    blocked = cli(capsys, "compare", f"{result}:control", result, "--out", tmp_path / "a-file" / "cmp")
    assert blocked.returncode == 2 and "--out" in blocked.stderr and len(blocked.stderr.strip().splitlines()) == 1


def test_compare_json_is_the_verdict_for_a_program(finished_run, tmp_path, capsys):
    """`qual compare --json`: the verdict as one JSON document naming its schema (qual.verdict/1), every check with
    its numbers, instead of the verdict's lines."""
    result = finished_run[1] / "out" / "result.json"
    proc = cli(capsys, "compare", f"{result}:control", result, "--out", tmp_path / "cmp", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    written = json.loads((tmp_path / "cmp" / "result.json").read_text())
    assert (data["schema"], data["outcome"], data["passed"], data["exit_code"]) == ("qual.verdict/1", "pass", True, 0)
    assert data["checks"] == written["gate"]["checks"] and data["control"]["ref"] == f"{result}:control"
    assert data["control"]["rate"] == written["arms"]["control"]["acceptance"]["rate"]
    assert data["files"]["json"] == str(tmp_path / "cmp" / "result.json")


def _copy_run(finished_run, tmp_path) -> tuple[Path, Path]:
    """A copy of the finished run whose run.json records into a history of its own."""
    import shutil

    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    shutil.copytree(finished_run[1] / "out", out)
    plan = json.loads((out / "run.json").read_text())
    plan["options"]["history"] = str(db)
    (out / "run.json").write_text(json.dumps(seal(plan)))  # resealed: qual refuses a run.json edited by hand
    return out, db


def _impossible(rec: dict) -> dict:
    return {**rec, "accepted_tokens": rec["draft_tokens"] + 1}  # more accepted than were drafted


def test_resume_refuses_an_impossible_journal_record_before_any_arm_runs(finished_run, tmp_path, capsys):
    out, db = _copy_run(finished_run, tmp_path)
    journal = out / "candidate.requests.jsonl"
    lines = journal.read_text().splitlines()
    rec = json.loads(lines[2])
    journal.write_text("\n".join([*lines[:2], json.dumps(sealed(_impossible(rec))), *lines[3:]]) + "\n")
    (out / "control.requests.jsonl").write_text("")  # the control arm would have to run again: it must not
    proc = cli(capsys, "run", "--resume", out)
    assert proc.returncode == 2, proc.stderr
    assert f"candidate.requests.jsonl:3: request {rec['id']}: accepted_tokens" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert (out / "control.requests.jsonl").read_text() == ""
    # the night ended in exit 2 with its folder: an error row says so (a run recorded with a verdict would keep it)
    assert [(r.outcome, r.exit_code) for r in history.list_runs(db)] == [("error", 2)]


def test_compare_refuses_an_impossible_result_record(finished_run, tmp_path, capsys):
    result = finished_run[1] / "out" / "result.json"
    data = json.loads(result.read_text())
    rec = data["arms"]["candidate"]["per_request"][1]
    data["arms"]["candidate"]["per_request"][1] = _impossible(rec)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    proc = cli(capsys, "compare", f"{result}:control", edited, "--out", tmp_path / "cmp")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"arms.candidate.per_request[1]: request {rec['id']}: accepted_tokens" in proc.stderr
    assert not (tmp_path / "cmp").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only): a real full filesystem under --out (the reports of a resumed run fit once the
    filler is gone)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_is_exit_2_leaves_no_temporary_file_and_resumes(profile, small_disk, tmp_path):
    stat = os.statvfs(small_disk)
    filler = small_disk / "filler"
    # Room for run.json and the journals (two pages each: every request's tokens and step times) and the arm records
    # (a page each), not for result.json.
    filler.write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - 36 * 1024))
    out, db = small_disk / "out", tmp_path / "h.sqlite"
    proc = qual("run", "--model", profile, "--dcp", 1, "--limit", 2, "--out", out, "--history", db)
    assert proc.returncode == 2, proc.stderr
    *progress, error = proc.stderr.strip().splitlines()  # the arms ran: their progress lines come first
    assert all(line.startswith("progress: ") for line in progress), proc.stderr
    assert error.startswith(f"error: cannot write {out / 'result.json'}: No space left on device")
    assert f"qual run --resume {out}" in error
    assert list(out.glob("*.tmp")) == [] and not (out / "result.json").exists()
    (row,) = history.list_runs(db)  # the night's error row (the history is on another disk), replaced by the resume
    assert (row.outcome, row.exit_code) == ("error", 2) and row.error.startswith("error: cannot write ")
    journaled = {arm: (out / f"{arm}.requests.jsonl").read_text() for arm in ("control", "candidate")}
    assert all(len(text.splitlines()) == 2 for text in journaled.values())
    filler.unlink()
    resumed = qual("run", "--resume", out)
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads((out / "result.json").read_text())
    for arm, text in journaled.items():  # nothing ran again: the result is the journal
        assert (out / f"{arm}.requests.jsonl").read_text() == text
        assert result["arms"][arm]["per_request"] == [{k: v for k, v in json.loads(line).items() if k != "sealed"}
                                                      for line in text.splitlines()]  # each line's digest aside
    assert history_rows(db) == 1 and list(out.glob("*.tmp")) == []
    assert history.get_run(db, row.id).outcome == "pass"


def test_runs_with_the_default_out_in_the_same_second_get_their_own_folders(profile, tmp_path, capsys, monkeypatch):
    """The default --out is named by the second it starts in: a run that finds that folder taken (another run
    started in the same second) takes NAME-2 instead of refusing a folder the user never named."""
    from datetime import datetime, timezone

    from qual.harness import plan

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 12, 5, 7, 15, 20, tzinfo=timezone.utc)

    monkeypatch.setattr(plan, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)
    taken = Path("reports") / f"20261205T071520Z-{Path(profile).stem}-dcp2"
    taken.mkdir(parents=True)
    (taken / "run.json").write_text("{}")  # the other run's
    res = cli(capsys, "run", "--model", profile, "--dcp", 2, "--limit", 1, "--history", tmp_path / "h.sqlite", "-q")
    assert res.returncode == 0, res.stderr
    assert (taken.with_name(taken.name + "-2") / "result.json").is_file()
    assert (taken / "run.json").read_text() == "{}"
