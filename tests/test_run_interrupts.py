"""`qual run --dcp 4` as CI meets it: what it listens on, and SIGTERM / SIGINT during the candidate arm.

One uninterrupted run is the reference (its sockets are read while it runs). A second run is interrupted six
times at different points of its candidate arm (the fork server's imports, rank start-up, the rendezvous, between requests,
within one; SIGTERM and SIGINT, to the driver or to its whole process group as a terminal's Ctrl-C or a CI runner does),
each time resumed from where the last one stopped; the finished run must equal the reference exactly.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoints import make_profile
from nic_env import nic_env
from qual.harness.journal import read_journal
from qual.proc import alive, descendants, group_members, listeners, parent_of

pytestmark = pytest.mark.slow

QUAL = [sys.executable, "-m", "qual"]
# The six kills let a few candidate requests finish (at least one after each of the three "a result" points, more
# on an idle machine): 12 leave the final resume work.
REQUESTS = 12
EXIT_WITHIN_S = 10.0
EVENT_TIMEOUT_S = 240.0  # the machine may be slow: how long to wait for a kill point to come


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupts")
    profile = make_profile(root / "prof", reference={"max_num_seqs": 1})
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"q{i:02d}", "prompt": f"def f{i}(x):\n    return x * {i}",
                                          "max_tokens": 6}) + "\n" for i in range(REQUESTS)))
    return root, profile, corpus


def _start(args) -> subprocess.Popen:
    return subprocess.Popen([*QUAL, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=nic_env(), start_new_session=True)  # its own group: the run's processes are its members


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _servers(pid: int, below: list[int] | None = None) -> list[int]:
    """The driver's fork server (qual/runtime/launch.py), if it has started one."""
    below = descendants(pid) if below is None else below
    return [p for p in below if b"multiprocessing.forkserver" in _cmdline(p) and parent_of(p) == pid]


def _ranks(pid: int) -> list[int]:
    """The driver's rank processes: its fork server's children, or spawned ones."""
    below = descendants(pid)
    servers = _servers(pid, below)
    return [p for p in below if p not in servers and (parent_of(p) in servers or b"spawn_main" in _cmdline(p))]


@pytest.fixture(scope="module")
def uninterrupted(setup):
    """The reference run, its listening sockets sampled every 0.1 s while it runs."""
    root, profile, corpus = setup
    out = root / "reference"
    t0 = time.monotonic()
    proc = _start(["run", "--model", profile, "--dcp", 4, "--corpus", corpus, "--out", out, "--history", root / "ref.sqlite"])
    seen, most_ranks = set(), 0
    while proc.poll() is None:
        tree = [proc.pid, *descendants(proc.pid)]
        seen |= set(listeners(tree))
        most_ranks = max(most_ranks, len(_ranks(proc.pid)))
        time.sleep(0.1)
    stderr = proc.stderr.read()
    print(f"\nreference run: {time.monotonic() - t0:.1f} s")
    return proc.returncode, stderr, out, seen, most_ranks


def test_nothing_listens_beyond_loopback(uninterrupted):
    code, stderr, _, seen, most_ranks = uninterrupted
    assert code == 0, stderr
    assert most_ranks == 3  # the sampler saw the three rank processes of a TP 4 arm
    assert seen, "no listening socket seen: the sampler cannot have worked (gloo's pairs listen)"
    assert [s for s in seen if not s.loopback] == [], "sockets of qual's processes reachable beyond this host"


def _wait(proc: subprocess.Popen, cond, what: str) -> None:
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while not cond():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within {EVENT_TIMEOUT_S:.0f} s"
        time.sleep(0.02)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# (the point in the candidate arm, seconds after it, the signal, to the whole group?): each phase of the arm once, each
# signal to the driver and to the group
KILLS = [
    ("ranks started", 0.0, signal.SIGTERM, False),  # the ranks are unpickling their arguments
    ("the fork server started", 1.0, signal.SIGINT, True),  # it is importing torch; Ctrl-C in a terminal: the group
    ("a result", 0.0, signal.SIGTERM, False),  # between requests
    ("a result", 0.25, signal.SIGINT, False),  # the next request's prefill or decode steps
    ("a result", 0.4, signal.SIGTERM, True),  # a CI runner stopping the job's group, mid-request
    # rendezvous, weights, or the first steps (machine speed); early enough that the requests left are not all done,
    # which a kill after the run's end could not test
    ("ranks started", 2.0, signal.SIGTERM, False),
]


def untimed(records: list[dict]) -> list[dict]:
    """Request records without their latency: when tokens came differs between two runs, the tokens do not."""
    return [{k: v for k, v in r.items() if k != "latency"} for r in records]


def test_sigterm_during_the_candidate_arm_stops_at_once_and_resumes_exactly(setup, uninterrupted):
    root, profile, corpus = setup
    out = root / "interrupted"
    journal = out / "candidate.requests.jsonl"
    first = ["run", "--model", profile, "--dcp", 4, "--corpus", corpus, "--out", out, "--history", root / "h.sqlite"]
    t0 = time.monotonic()
    for n, (point, delay, sig, group) in enumerate(KILLS):
        proc = _start(first if n == 0 else ["run", "--resume", out])
        if n == 0:
            _wait(proc, journal.exists, "the candidate arm")
        before = _lines(journal)
        if point == "ranks started":
            _wait(proc, lambda: len(_ranks(proc.pid)) == 3, point)
        elif point == "the fork server started":
            _wait(proc, lambda: _servers(proc.pid) and not _ranks(proc.pid), point)
        else:
            _wait(proc, lambda: _lines(journal) > before, point)
        time.sleep(delay)
        tree = [proc.pid, *descendants(proc.pid)]
        assert proc.poll() is None, f"kill {n}: the run ended before the kill ({point} + {delay} s)"
        (os.killpg if group else os.kill)(proc.pid, sig)
        sent = time.monotonic()
        try:
            code = proc.wait(timeout=EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"kill {n} ({point} + {delay} s, {sig.name}): still running {EXIT_WITHIN_S:.0f} s later")
        took = time.monotonic() - sent
        stderr = proc.stderr.read()
        assert code == 130, f"kill {n} ({point} + {delay} s, {sig.name}): exit {code}: {stderr[-2000:]}"
        assert "Traceback" not in stderr, f"kill {n}: {stderr[-2000:]}"
        assert "exiting now" not in stderr, f"kill {n}: the unwinding blocked; the deadline ended it: {stderr[-500:]}"
        deadline = time.monotonic() + 3.0  # the multiprocessing resource tracker leaves on its own, at once
        while (left := [p for p in tree if alive(p)] + group_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left == [], f"kill {n}: processes of the run left behind: {left}"
        done = read_journal(journal)  # whole lines only, and nothing twice
        assert len(journal.read_text().splitlines()) == len(done) and not (out / "result.json").exists()
        print(f"kill {n}: {point} + {delay} s, {sig.name}{' to the group' if group else ''}: exit {code} "
              f"in {took:.2f} s; {len(done)}/{REQUESTS} candidate results journaled")
    assert len(read_journal(journal)) < REQUESTS
    resumed = subprocess.run([*QUAL, "run", "--resume", str(out)], capture_output=True, text=True, env=nic_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    print(f"{len(KILLS)} kills and the final resume: {time.monotonic() - t0:.1f} s")
    got = json.loads((out / "result.json").read_text())
    want = json.loads((uninterrupted[2] / "result.json").read_text())
    for arm in ("control", "candidate"):
        assert untimed(got["arms"][arm]["per_request"]) == untimed(want["arms"][arm]["per_request"]), arm
        assert got["arms"][arm]["acceptance"] == want["arms"][arm]["acceptance"], arm
        ids = [json.loads(line)["id"] for line in (out / f"{arm}.requests.jsonl").read_text().splitlines()]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == REQUESTS, arm
    assert got["gate"] == want["gate"]
