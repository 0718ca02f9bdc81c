"""The exit-code contract of qual/cli/main.py: 0 pass, 1 gate failed (nothing else), 2 usage/config/input,
3 engine failure, 4 internal error (one line, the traceback kept in a file), 130 interrupted.

The internal errors are real bugs injected in-process (a renderer or the planner breaks), on a DCP 1 arm pair:
TP 1, so no rank process starts.
"""

import sqlite3
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from checkpoints import make_profile
from qual.cli.main import EXIT_BROKEN_PIPE, EXIT_INTERNAL, _register, run_app


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    _register()
    return make_profile(tmp_path_factory.mktemp("prof"))


def _run(profile, tmp_path, *extra):
    return run_app(["run", "--model", str(profile), "--dcp", "1", "--limit", "2", "--max-tokens", "3",
                    "--out", str(tmp_path / "out"), "--history", str(tmp_path / "h.sqlite"), *extra])


def _one_line(capsys) -> str:
    """The error's one line: stderr's last; any before it are the run's progress (qual/cli/progress.py)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(ln.startswith("progress: ") for ln in err[:-1]), err
    return err[-1]


def test_a_broken_renderer_is_exit_4_with_the_traceback_in_the_run_directory(profile, tmp_path, monkeypatch, capsys):
    import qual.report.markdown

    def broken(*args, **kwargs):
        raise ZeroDivisionError("injected: the markdown renderer divides by zero")

    monkeypatch.setattr(qual.report.markdown, "write", broken)
    assert _run(profile, tmp_path) == EXIT_INTERNAL
    line = _one_line(capsys)
    crash = tmp_path / "out" / "crash.txt"
    assert line == f"internal error (a bug in qual): ZeroDivisionError: injected: the markdown renderer divides by zero; " \
                   f"traceback in {crash}"
    text = crash.read_text()
    assert text.startswith("Traceback") and "in broken" in text and "ZeroDivisionError" in text
    # both arms are journaled: the run is resumable once the bug is fixed; the history's row says it ended in exit 4
    for arm in ("control", "candidate"):
        assert len((tmp_path / "out" / f"{arm}.requests.jsonl").read_text().splitlines()) == 2
    assert _history_rows(tmp_path / "h.sqlite") == 1
    with sqlite3.connect(tmp_path / "h.sqlite") as conn:
        assert conn.execute("SELECT outcome, exit_code, error FROM runs").fetchall() == [("error", 4, line)]
    conn.close()
    # junit.xml says why the run has no verdict: one test case in error, the line stderr showed
    [case] = ET.parse(tmp_path / "out" / "junit.xml").getroot().iter("testcase")
    assert case.get("name") == "internal_error" and case.find("error").get("message") == line


def _history_rows(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db) as c:
        if not c.execute("select count(*) from sqlite_master where name = 'runs'").fetchone()[0]:
            return 0
        return c.execute("select count(*) from runs").fetchone()[0]


def test_a_bug_before_the_run_directory_exists_saves_a_temporary_file(profile, tmp_path, monkeypatch, capsys):
    import qual.harness.plan

    def broken(*a, **k):
        raise KeyError("injected")

    monkeypatch.setattr(qual.harness.plan, "make_plan", broken)
    assert _run(profile, tmp_path) == EXIT_INTERNAL
    line = _one_line(capsys)
    assert line.startswith("internal error (a bug in qual): KeyError: 'injected'; traceback in ")
    saved = Path(line.rsplit("traceback in ", 1)[1])
    try:
        assert "KeyError: 'injected'" in saved.read_text() and not (tmp_path / "out").exists()
    finally:
        saved.unlink()


def test_a_multiline_message_stays_one_bounded_line(profile, tmp_path, monkeypatch, capsys):
    import qual.report.markdown

    def broken(*args, **kwargs):
        raise RuntimeError("first line " + "x" * 500 + "\nsecond line")

    monkeypatch.setattr(qual.report.markdown, "write", broken)
    assert _run(profile, tmp_path) == EXIT_INTERNAL
    line = _one_line(capsys)
    assert "second line" not in line and len(line) < 400


def test_a_closed_stdout_is_not_gate_failed(tmp_path):
    """typer answers EPIPE with exit 1; qual says what a shell says of a process SIGPIPE ended."""
    proc = subprocess.Popen([sys.executable, "-m", "qual", "run", "--dry-run", "--out", str(tmp_path / "o")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE, err


def _qual_with(redirect: str, *args) -> subprocess.CompletedProcess:
    """`qual ARGS` through the console entry, started by a shell with `redirect` (`>&-`: stdout closed)."""
    return subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", sys.executable, "-m", "qual", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_a_stream_closed_at_start_drops_its_output_not_the_exit_code(profile, tmp_path):
    """Python starts with sys.stdout (sys.stderr) None where fd 1 (2) is closed: the command still does its work and
    exits with its own code. DCP 2: the rank processes inherit the /dev/null that takes the closed descriptor."""
    for args in (["schema"], ["--version"]):
        proc = _qual_with(">&-", *args)
        assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    run = ["run", "--model", profile, "--limit", "2", "--max-tokens", "3", "--history", tmp_path / "h.sqlite", "-q"]
    proc = _qual_with(">&-", *run, "--dcp", "2", "--out", tmp_path / "closed-stdout")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert (tmp_path / "closed-stdout" / "result.json").is_file()
    proc = _qual_with("2>&-", *run, "--dcp", "1", "--out", tmp_path / "closed-stderr")
    assert proc.returncode == 0 and proc.stdout.startswith("PASS: "), proc.stdout
    assert _history_rows(tmp_path / "h.sqlite") == 2


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_stdout_that_refuses_writes_is_one_line_and_exit_2():
    """A full disk under stdout is the user's to fix, as an output file's is (qual.files.WriteError), not a bug."""
    for args in (["schema"], ["--version"]):  # a write the command makes; output still buffered when it returns
        proc = _qual_with(">/dev/full", *args)
        assert (proc.returncode, proc.stderr) == (2, "error: cannot write to stdout: No space left on device\n")


def test_a_reader_gone_before_the_verdict_is_141_and_the_night_stays_a_pass(profile, tmp_path):
    """`qual run ... | head -3`: the run's outputs and its history row are written before the verdict is printed; a
    stdout closed then is exit 141, never a bug's exit 4 whose junit.xml would replace the passing gate's."""
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    proc = subprocess.Popen([sys.executable, "-m", "qual", "run", "--model", str(profile), "--dcp", "1", "--limit", "2",
                             "--max-tokens", "3", "--out", str(out), "--history", str(db), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == EXIT_BROKEN_PIPE, err
    assert "internal error" not in err and not (out / "crash.txt").exists()
    [case] = [c for c in ET.parse(out / "junit.xml").getroot().iter("testcase") if c.get("name") == "candidate_runnable"]
    assert case.find("error") is None and case.find("failure") is None
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT outcome FROM runs").fetchall() == [("pass",)]
    conn.close()


def test_an_error_row_that_cannot_be_written_keeps_the_runs_own_exit_code(profile, tmp_path, monkeypatch, capsys):
    """The error row is best effort: a damaged history (sqlite3.DatabaseError) or a bug in writing it must not
    replace the error being reported (was: the row's own exception, a second exit 4 about something else)."""
    import qual.harness.error_night
    import qual.report.markdown

    def broken(*args, **kwargs):
        raise ZeroDivisionError("injected: the markdown renderer divides by zero")

    def damaged(*a, **k):
        raise sqlite3.DatabaseError("database disk image is malformed")

    monkeypatch.setattr(qual.report.markdown, "write", broken)
    monkeypatch.setattr(qual.harness.error_night, "record_error", damaged)
    assert _run(profile, tmp_path) == EXIT_INTERNAL
    assert "ZeroDivisionError: injected" in _one_line(capsys)
