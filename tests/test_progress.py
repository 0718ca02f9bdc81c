"""qual/cli/progress.py: plain lines in a log, a live bar on a terminal, nothing with -q; the ETA and line formats."""

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from qual.cli.progress import (DEFAULT_INTERVAL_S, INTERVAL_ENV, PREFIX, RunProgress, acceptance, clock, eta_seconds,
                               interval_s)
from qual.errors import QualError
from qual.harness.execute import DECODING, DONE, REPORTS, STARTING, ArmProgress

QUAL = [sys.executable, "-m", "qual"]
# The shipped toy pair: two arms of TP 2 (rank processes start). Four tokens a request: the progress lines are per
# request and per phase, so the toy's own 64 only make each run slower.
RUN = ["run", "--dcp", "2", "--limit", "4", "--max-tokens", "4"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# -- the pure parts ------------------------------------------------------------------------------------------------

def test_clock():
    assert [clock(s) for s in (0, 7.9, 750, 3723, -1)] == ["0:00", "0:07", "12:30", "1:02:03", "0:00"]


def test_eta_is_the_rate_since_the_first_finished_request():
    assert eta_seconds(10, 0, None, None, 5.0) is None  # nothing finished: no rate
    assert eta_seconds(10, 1, 1, 5.0, 9.0) is None  # one finished: still no rate (start-up is not counted)
    assert eta_seconds(10, 3, 1, 5.0, 9.0) == pytest.approx(14.0)  # 2 in 4 s: 7 left take 14 s
    assert eta_seconds(10, 6, 5, 5.0, 7.0) == pytest.approx(8.0)  # resumed with 4: counted from the first new one
    assert eta_seconds(10, 10, 1, 5.0, 9.0) == 0.0


def test_acceptance_text():
    assert acceptance(230, 480) == "47.92% (230/480 draft tokens)"
    assert acceptance(0, 0) == "n/a"


def test_interval_from_the_environment():
    assert interval_s({}) == DEFAULT_INTERVAL_S == 30.0
    assert interval_s({INTERVAL_ENV: "0.25"}) == 0.25
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(QualError, match=INTERVAL_ENV):
            interval_s({INTERVAL_ENV: bad})


def _event(arm, phase, done, total=20, accepted=0, drafted=0, resumed=0):
    return ArmProgress(arm, phase, done, total, resumed, accepted, drafted)


def test_a_log_gets_phase_changes_and_every_tenth_not_every_request():
    stream = io.StringIO()
    with RunProgress({"control": "control (dcp 1, tp 1)"}, stream=stream, interval=3600) as progress:
        progress(_event("control", STARTING, 0))
        for done in range(1, 21):
            progress(_event("control", DECODING, done, accepted=done, drafted=2 * done))
        progress(_event("control", DONE, 20, accepted=20, drafted=40))
        progress(_event("run", REPORTS, 0, total=0))
    progress(_event("control", DONE, 20))  # after the end: nothing
    lines = stream.getvalue().splitlines()
    assert all(line.startswith(PREFIX) for line in lines)
    # the first finished request is a phase change; then a line at each tenth (2 of 20), none between
    shown = [line.split(" | ")[2] for line in lines[1:-2]]
    assert shown == [f"{n}/20 requests ({5 * n}%)" for n in (1, *range(2, 21, 2))]
    assert lines[0] == (f"{PREFIX}control (dcp 1, tp 1) | starting engine, first requests | 0/20 requests (0%) | "
                        "elapsed 0:00 | ETA unknown | acceptance n/a")
    assert lines[-2].endswith("| done | 20/20 requests (100%) | elapsed 0:00 | ETA 0:00 | acceptance 50.00% "
                              "(20/40 draft tokens)")
    assert lines[-1] == f"{PREFIX}run | writing reports | elapsed 0:00"


def test_a_heartbeat_repeats_the_state_and_stops_at_the_end():
    stream = io.StringIO()
    with RunProgress({}, stream=stream, interval=0.05) as progress:
        time.sleep(0.2)  # no arm yet: nothing to say
        assert stream.getvalue() == ""
        progress(_event("control", STARTING, 0))
        time.sleep(0.4)
    ended = stream.getvalue()
    time.sleep(0.2)
    assert stream.getvalue() == ended
    lines = ended.splitlines()
    assert len(lines) >= 3 and len({line.split(" | elapsed")[0] for line in lines}) == 1, lines


def test_quiet_shows_nothing():
    stream = io.StringIO()
    with RunProgress({}, stream=stream, interval=0.01, quiet=True) as progress:
        progress(_event("control", STARTING, 0))
        time.sleep(0.1)
    assert stream.getvalue() == ""


# -- the real `qual run` -------------------------------------------------------------------------------------------

def _run(tmp_path, *extra, env=None, stderr=subprocess.PIPE):
    out = tmp_path / "out"
    proc = subprocess.run([*QUAL, *RUN, *extra, "--out", str(out), "--history", str(tmp_path / "h.sqlite")],
                          stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    return proc, out


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A run whose stdout and stderr go to one file (a CI log), with a heartbeat every 0.2 s."""
    root = tmp_path_factory.mktemp("logged")
    log = root / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.run([*QUAL, *RUN, "--out", str(root / "out"), "--history", str(root / "h.sqlite")],
                              stdout=f, stderr=subprocess.STDOUT, timeout=600,
                              env={**os.environ, INTERVAL_ENV: "0.2"})
    return proc.returncode, log.read_text(), root / "out"


def test_a_log_has_plain_lines_for_every_phase_of_both_arms(logged):
    code, text, _ = logged
    assert code == 0, text
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    progress = [line for line in lines if line.startswith(PREFIX)]
    for arm, dcp in (("control", 1), ("candidate", 2)):
        mine = [line for line in progress if line.startswith(f"{PREFIX}{arm} (dcp {dcp}, tp 2) | ")]
        phases = [line.split(" | ")[1] for line in mine]
        assert phases[0] == "starting engine, first requests" and phases[-1] == "done", mine
        assert "decoding" in phases
        assert re.search(r"\| 0/4 requests \(0%\) \| elapsed \d+:\d\d \| ETA unknown \| acceptance n/a$", mine[0])
        assert re.search(r"\| 4/4 requests \(100%\) \| elapsed \d+:\d\d \| ETA 0:00 \| acceptance \d+\.\d\d% "
                         r"\(\d+/\d+ draft tokens\)$", mine[-1])
        # the heartbeat: the starting line again while the engine starts (a phase change is shown once)
        assert phases.count("starting engine, first requests") >= 2, mine
    assert any(line.startswith(f"{PREFIX}run | writing reports | elapsed ") for line in progress)
    # nothing after the run ended: the verdict (stdout) follows the last progress line
    verdict = next(i for i, line in enumerate(lines) if line.startswith("PASS: "))
    assert max(i for i, line in enumerate(lines) if line.startswith(PREFIX)) < verdict


def test_quiet_silences_progress_and_leaves_stdout_as_it_was(logged, tmp_path):
    _, text, logged_out = logged
    proc, out = _run(tmp_path, "-q")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    verdict = [line for line in text.splitlines() if not line.startswith(PREFIX)]
    assert proc.stdout.splitlines() == [line.replace(str(logged_out), str(out)) for line in verdict]
    again = subprocess.run([*QUAL, "run", "--resume", str(out), "--quiet"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stderr == "", again.stderr  # -q is no run input: allowed with --resume


def test_a_terminal_gets_the_live_bar(tmp_path):
    main, child = pty.openpty()
    out = tmp_path / "out"
    proc = subprocess.Popen([*QUAL, *RUN, "--out", str(out), "--history", str(tmp_path / "h.sqlite")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=child,
                            env={**os.environ, "COLUMNS": "200", "TERM": "xterm"})
    os.close(child)
    shown = b""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the run closed its end
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    os.close(main)
    stdout = proc.stdout.read().decode()
    assert proc.wait(timeout=60) == 0, shown.decode(errors="replace")[-3000:]
    assert "\x1b" not in stdout and stdout.startswith("PASS: ")  # the bar stays on stderr
    text = ANSI.sub("", shown.decode(errors="replace"))
    assert "\x1b[" in shown.decode(errors="replace")  # drawn and redrawn in place
    for arm, dcp in (("control", 1), ("candidate", 2)):
        assert re.search(rf"{arm} \(dcp {dcp}, tp 2\) .*\b(starting engine, first requests|decoding) \| \d/4 requests",
                         text)
        assert re.search(rf"{arm} \(dcp {dcp}, tp 2\) .*\bdone \| 4/4 requests \(100%\) \| elapsed \d+:\d\d \| "
                         rf"ETA 0:00 \| acceptance \d+\.\d\d%", text)
    assert re.search(r"ETA \d+:\d\d", text) and "reports written" in text
