"""`qual run` against a careless or hostile user, the run directory's side: a resume runs exactly the run that
started, one process owns a run directory, output files are never written through links, the history is checked
before any arm runs and a locked one is waited for, and signals from the first instruction on are exit 130."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from checkpoints import make_profile
from cli_inprocess import qual_in
from qual.errors import QualError
from qual.files import DirectoryLock
from qual.harness.journal import sealed

pytestmark = pytest.mark.slow  # whole runs: scheduled first (tests/conftest.py)

QUAL = [sys.executable, "-m", "qual"]


def qual(*args, timeout=300, **kw):
    return subprocess.run([*QUAL, *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw)


def history_rows(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db) as c:
        return c.execute("select count(*) from runs").fetchone()[0]


def snapshot(out: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run of 4 requests with a profile of its own (max_tokens 16); DCP 1 at TP 1 (no rank processes): the
    run directory is what these tests use (the runs that need ranks, below, start their own)."""
    root = tmp_path_factory.mktemp("hostile")
    profile = make_profile(root / "prof", max_tokens=16)
    out, db = root / "out", root / "h.sqlite"
    proc = qual("run", "--model", profile, "--dcp", 1, "--tp", 1, "--limit", 4, "--out", out, "--history", db)
    assert proc.returncode == 0, proc.stderr
    return root, profile, out, db


def copy_run(run, tmp_path) -> Path:
    import shutil

    out = tmp_path / "out"
    shutil.copytree(run[2], out)
    return out


def test_a_resume_after_the_profile_changed_is_refused_naming_what_changed(run, tmp_path, capsys):
    root, profile, _, db = run
    out = copy_run(run, tmp_path)
    (out / "candidate.requests.jsonl").write_text("")  # the candidate arm as if killed before its first request
    (out / "candidate.arm.json").unlink()
    edited = yaml.safe_load(profile.read_text())
    original = profile.read_text()
    try:
        profile.write_text(yaml.safe_dump({**edited, "max_tokens": 40}))
        before, rows = snapshot(out), history_rows(db)
        proc = qual_in(capsys, "run", "--resume", out)
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.strip()
        assert len(line.splitlines()) == 1 and "the run's inputs changed since it started" in line
        assert "arms.candidate.sampling.max_tokens 16 -> 40" in line and "profile.sha256" in line
        assert snapshot(out) == before and history_rows(db) == rows  # nothing ran, nothing was written
    finally:
        profile.write_text(original)


def test_a_run_started_before_an_option_existed_resumes(run, tmp_path):
    """run.json of a qual that had no --baseline-any: the option, left off now, is what that run ran."""
    from qual.harness.inputs import seal

    out = copy_run(run, tmp_path)
    (out / "candidate.requests.jsonl").write_text("")
    (out / "candidate.arm.json").unlink()
    plan = json.loads((out / "run.json").read_text())
    del plan["options"]["baseline_any"], plan["inputs"]["options"]["baseline_any"], plan["sealed"]
    (out / "run.json").write_text(json.dumps(seal(plan)))
    proc = qual("run", "--resume", out, "-q")
    assert proc.returncode == 0, proc.stderr


def test_an_edited_run_json_is_refused(run, tmp_path, capsys):
    out = copy_run(run, tmp_path)
    plan = json.loads((out / "run.json").read_text())
    plan["options"]["model"] = "toy"  # the records would be labelled as another model's
    (out / "run.json").write_text(json.dumps(plan))
    proc = qual_in(capsys, "run", "--resume", out)
    assert proc.returncode == 2 and "run.json: edited since the run started" in proc.stderr


def test_a_journal_of_another_run_is_refused_before_any_arm_runs(run, tmp_path, capsys):
    out = copy_run(run, tmp_path)
    lines = (out / "candidate.requests.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    rec["prompt_token_ids"] = rec["prompt_token_ids"][1:]  # another prompt: a journal copied from another run
    (out / "candidate.requests.jsonl").write_text("\n".join([json.dumps(sealed(rec)), *lines[1:]]) + "\n")
    (out / "candidate.arm.json").unlink()
    proc = qual_in(capsys, "run", "--resume", out)
    assert proc.returncode == 2 and "describe different runs" in proc.stderr, proc.stderr


def test_flags_beside_resume_are_refused(run, tmp_path, capsys):
    out = copy_run(run, tmp_path)
    for flag, value in (("--dcp", "4"), ("--out", str(tmp_path / "x")), ("--limit", "2")):
        proc = qual_in(capsys, "run", "--resume", out, flag, value)
        assert proc.returncode == 2 and f"{flag} with --resume" in proc.stderr, proc.stderr


def test_one_process_owns_a_run_directory(run, tmp_path):
    """A second resume while the first holds the directory is exit 2 at once, naming the holder's pid; nothing
    is journaled twice."""
    out = copy_run(run, tmp_path)
    before = snapshot(out)
    lock = DirectoryLock(out, "--resume")  # this process is the first resume
    try:
        start = time.monotonic()
        proc = qual("run", "--resume", out)
        assert proc.returncode == 2 and f"in use by another qual process (pid {os.getpid()})" in proc.stderr
        assert time.monotonic() - start < 30 and snapshot(out) == before
        with pytest.raises(QualError, match="in use by another qual process"):
            DirectoryLock(out, "--out")
    finally:
        lock.release()
    DirectoryLock(out, "--out").release()  # free again


def test_links_in_the_run_directory_are_never_written_through(run, tmp_path):
    out = copy_run(run, tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (out / "summary.md.tmp").symlink_to(victim)  # the old temporary name
    (out / "report.html").unlink()
    (out / "report.html").symlink_to(victim)
    proc = qual("run", "--resume", out)
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == "precious\n"
    assert not (out / "summary.md").is_symlink() and not (out / "report.html").is_symlink()
    assert (out / "report.html").read_text().startswith("<!")
    journal = out / "control.requests.jsonl"
    kept = journal.read_text()
    journal.unlink()
    journal.symlink_to(victim)
    (out / "control.arm.json").unlink()
    proc = qual("run", "--resume", out)
    assert proc.returncode == 2 and "control.requests.jsonl" in proc.stderr
    assert victim.read_text() == "precious\n" and kept


@pytest.mark.parametrize("kind", ["device", "fifo", "dangling link", "link loop", "damaged"])
def test_an_unusable_history_is_refused_before_any_arm_runs(run, tmp_path, capsys, kind):
    _, profile, _, db = run
    if kind == "device":
        history = Path("/dev/null")
    else:
        history = tmp_path / "h.sqlite"
        if kind == "fifo":
            os.mkfifo(history)
        elif kind == "dangling link":
            history.symlink_to(tmp_path / "nowhere" / "h.sqlite")
        elif kind == "link loop":
            history.symlink_to(tmp_path / "loop")
            (tmp_path / "loop").symlink_to(history)
        else:
            data = bytearray(db.read_bytes())
            data[4096:4096 + 100] = b"\xff" * 100  # the second page's header, trampled
            history.write_bytes(bytes(data))
    siblings = set(history.parent.iterdir())
    start = time.monotonic()
    proc = qual_in(capsys, "run", "--model", profile, "--dcp", 2, "--limit", 2, "--out", tmp_path / "out",
                   "--history", history)
    assert proc.returncode == 2, proc.stderr
    assert "--history" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert time.monotonic() - start < 60 and not (tmp_path / "out").exists()  # refused at plan time
    assert set(history.parent.iterdir()) == siblings  # no -journal or -wal beside it
    listed = qual_in(capsys, "history", "list", "--history", history)
    assert listed.returncode == 2 and set(history.parent.iterdir()) == siblings


def test_a_locked_history_is_waited_for_then_named_with_the_resume_command(run, tmp_path, monkeypatch, capsys):
    from qual import history
    from qual.harness.execute import execute
    from qual.harness.plan import make_plan, run_options

    import shutil

    _, profile, _, _ = run
    db = tmp_path / "h.sqlite"
    monkeypatch.setattr(history.store, "LOCK_TIMEOUT_S", 1.0)
    plan = make_plan(run_options(model=str(profile), dcp=1, tp=1, limit=2, out=str(tmp_path / "out"), history=str(db)))
    shutil.copy(run[3], db)  # a history with a run in it
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(QualError, match=r"stayed locked by another process for 1 s; the run's reports are "
                                            r"written in .*: record it in the history with `qual run --resume"):
            execute(plan)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert "is being written by another process: waiting up to 1 s" in capsys.readouterr().err
    assert (tmp_path / "out" / "result.json").exists()  # the reports are there to record


def wait_for_handlers(pid: int, timeout: float = 30) -> None:
    """Until the process catches SIGHUP (/proc/PID/status SigCgt): qual's first instruction has run. Before it,
    Python itself is still starting (tens of milliseconds), which no program's code can answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt"))
        if int(caught.split()[1], 16) >> (signal.SIGHUP - 1) & 1:
            return
        time.sleep(0.001)
    raise AssertionError("the handlers were never installed")


@pytest.mark.parametrize("delay", [0, 0.02, 0.1, 0.3])
@pytest.mark.parametrize("command", [["history", "list"], ["run", "--dry-run"]])
def test_a_signal_during_start_up_is_exit_130_without_a_traceback(tmp_path, command, delay):
    args = [*QUAL, *command, "--history", str(tmp_path / "h.sqlite")]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_handlers(proc.pid)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if proc.returncode in (0, 2):
        pytest.skip("the command finished before the signal came")  # a fast machine: nothing to interrupt
    assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err, err


def test_sighup_ends_a_run_with_130_and_a_message(run, tmp_path):
    _, profile, _, _ = run
    args = [*QUAL, "run", "--model", str(profile), "--dcp", "2", "--out", str(tmp_path / "out"), "--history",
            str(tmp_path / "h.sqlite")]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "out" / "control.requests.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "qual run --resume" in err, err


@pytest.mark.parametrize("length", ["short", "too long for a socket"])
def test_a_run_leaves_nothing_in_the_temp_directory(run, tmp_path, length):
    """Whatever the children put in the temp directory goes in one private folder, removed at the end; a TMPDIR
    too long for Unix sockets below it is passed over for /tmp rather than failing in multiprocessing."""
    import shutil
    import tempfile

    _, profile, _, _ = run
    tmp = Path(tempfile.mkdtemp(prefix="q", dir="/tmp"))
    if length != "short":
        tmp = tmp / ("d" * 90)
        tmp.mkdir()
    try:
        proc = qual("run", "--model", profile, "--dcp", 2, "--limit", 2, "--out", tmp_path / "out", "--history",
                    tmp_path / "h.sqlite", env={**os.environ, "TMPDIR": str(tmp)})
        assert proc.returncode == 0, proc.stderr
        assert list(tmp.iterdir()) == []  # no pymp-*, qual-rdzv-*, fork-server sockets
    finally:
        shutil.rmtree(tmp if length == "short" else tmp.parent)


def test_torch_that_cannot_load_is_an_engine_failure_saying_so(run, tmp_path):
    """A memory limit below what torch's libraries map: exit 3 naming torch, not 'a bug in qual'."""
    import resource

    _, profile, _, _ = run
    limit = 600 << 20
    proc = qual("run", "--model", profile, "--dcp", 1, "--tp", 1, "--limit", 1, "--out", tmp_path / "out",
                "--history", tmp_path / "h.sqlite",
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert proc.returncode == 3 and "could not load torch" in proc.stderr, proc.stderr
