"""Where a CPU engine's rank processes come from (qual/runtime/launch.py), with real processes: one fork server per
driver process, preloaded once and serving every engine; it and its ranks ignore the group's stop signals and die
with the driver.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qual.proc import alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals and /proc are Linux's")

GONE_WITHIN_S = 5.0

# A driver that builds two TP 2 engines one after the other and prints, for each, what /proc says about its rank
# and the rank's parent; with "hold" it prints after the first engine's generate and waits there. Before the second
# engine it sets QUAL_HANG_DUMP_S: that engine's rank prints its stacks (the server started without it).
_DRIVER = textwrap.dedent("""
    import json, os, sys, time
    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import GenerationRequest, LLMEngine

    def facts(pid):
        status = dict(line.split(":\\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\\t" in line)
        return {"pid": pid, "ppid": int(status["PPid"]), "threads": int(status["Threads"]),
                "ignored": int(status["SigIgn"], 16), "cmdline": open(f"/proc/{pid}/cmdline").read()}

    def main():
        target, draft, mode = sys.argv[1:4]
        cfg = EngineConfig(target, draft, ParallelConfig(2, 1), CacheConfig(block_size=4, memory_bytes=2**22), dtype="float64")
        seen = []
        for n in range(2):
            if n == 1:
                os.environ["QUAL_HANG_DUMP_S"] = "0.2"
            with LLMEngine(cfg) as engine:
                engine.generate([GenerationRequest("r0", (1, 2, 3), 4)], SamplingParams(max_tokens=4))
                rank = facts(engine.workers[0].pid)
                seen.append({"rank": rank, "server": facts(rank["ppid"])})
                if mode == "hold":
                    print(json.dumps(seen), flush=True)
                    time.sleep(600)
                time.sleep(n)  # the second rank's stack dumps
        print(json.dumps(seen), flush=True)

    if __name__ == "__main__":
        main()
""")


def _driver(tmp_path: Path, tiny_pair, mode: str) -> subprocess.Popen:
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    # A killed driver's rank may print its peer's closed connection before its parent-death signal lands.
    return subprocess.Popen([sys.executable, str(script), *map(str, tiny_pair), mode], stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL if mode == "hold" else subprocess.PIPE)


def test_both_engines_fork_their_ranks_from_one_preloaded_server_that_ran_no_torch_operation(tmp_path, tiny_pair):
    proc = _driver(tmp_path, tiny_pair, "report")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    first, second = json.loads(out)
    server = first["server"]
    assert second["server"]["pid"] == server["pid"], "the second engine started a server of its own"
    assert server["ppid"] == proc.pid and "multiprocessing.forkserver" in server["cmdline"]
    assert first["rank"]["pid"] != second["rank"]["pid"]
    # Forking is safe only where no torch operation started OpenMP or MKL threads: after serving both engines the
    # server still runs one thread (numpy's OpenBLAS pool, which its imports start, stops at the first fork).
    assert second["server"]["threads"] == 1
    for pid in ("rank", "server"):
        for facts in (first[pid], second[pid]):
            for sig in (signal.SIGINT, signal.SIGTERM):
                assert facts["ignored"] >> (sig - 1) & 1, f"the {pid} does not ignore {sig.name}"
    assert "_worker_main" in err, "the second engine's rank did not take the driver's QUAL_HANG_DUMP_S"


def test_a_killed_driver_takes_the_server_and_its_ranks_at_once(tmp_path, tiny_pair):
    proc = _driver(tmp_path, tiny_pair, "hold")
    try:
        (held,) = json.loads(proc.stdout.readline())
    finally:
        killed = time.monotonic()
        proc.kill()  # SIGKILL: nothing of the driver's runs
        proc.wait()
    pids = [held["rank"]["pid"], held["server"]["pid"]]
    deadline = killed + GONE_WITHIN_S
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [p for p in pids if alive(p)] == [], f"still alive {GONE_WITHIN_S:.0f} s after kill -9 of the driver"
    print(f"\nserver and rank gone {time.monotonic() - killed:.2f} s after kill -9 of the driver")


_PLANNER = textwrap.dedent("""
    import json, os, sys
    from qual.harness.plan import RunOptions, make_plan
    from qual.proc import descendants

    def servers():
        cmd = lambda p: open(f"/proc/{p}/cmdline").read()
        return [p for p in descendants(os.getpid()) if "multiprocessing.forkserver" in cmd(p)]

    dry = make_plan(RunOptions(model="toy", dcp=2, limit=1, out=sys.argv[1]), dry_run=True)
    after_dry = servers()
    make_plan(RunOptions(model="toy", dcp=2, limit=1, out=sys.argv[1]))
    after_plan = servers()
    print(json.dumps([after_dry, after_plan]))
""")


def test_a_real_runs_plan_starts_the_rank_server_and_a_dry_run_does_not(tmp_path):
    """The fork server starts when a TP > 1 CPU arm passes its preflight (its imports then overlap the driver's own
    and the corpus's), not on a dry run, which starts nothing."""
    script = tmp_path / "planner.py"
    script.write_text(_PLANNER)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after_dry, after_plan = json.loads(proc.stdout.splitlines()[-1])
    assert after_dry == [] and len(after_plan) == 1, (after_dry, after_plan)


_RANK = textwrap.dedent("""
    import os, sys
    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig
    from qual.runtime.ranks import _worker_main

    cfg = EngineConfig("target", "draft", ParallelConfig(4, 4), CacheConfig(block_size=4, memory_bytes=2**22))
    rendezvous = sys.argv[1]
    _worker_main(1, cfg, (), rendezvous, f"file://{rendezvous}/store", os.getppid(), False, None)
""")


def test_a_rank_whose_driver_stopped_before_it_started_exits_quietly(tmp_path):
    """A stop signal while the ranks start (SIGTERM to `qual run --dcp 4`): the driver removes the rendezvous and
    exits 130 saying why; a rank that comes up after that cannot mark itself ready, and exits 1 with nothing on
    stderr (it printed FileNotFoundError's traceback for ready.1 under the driver's line)."""
    gone = tmp_path / "qual-rdzv-removed"
    rank = subprocess.run([sys.executable, "-c", _RANK, str(gone)], capture_output=True, text=True, timeout=120)
    assert rank.returncode == 1 and rank.stderr == "", rank.stderr

