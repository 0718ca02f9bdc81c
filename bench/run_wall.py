"""Wall time of `qual run --dcp 4 --limit 64` on the toy default (the CPU target: <= 45 s on 2 cores).

    .venv/bin/python bench/run_wall.py [--phases] [--dcp 4] [--limit 64] [extra qual run args...]

--phases sets QUAL_PHASE_TIMES=1 for the run and prints rank 0's host time per decode step by phase
(qual/runtime/phases.py), per arm. The timers cost a clock read per phase; the default run has none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qual.runtime.phases import PHASES


def print_phases(arm: str, times: dict) -> None:
    ms = times["ms_per_step"]
    parts = ", ".join(f"{p} {ms[p]:.2f}" for p in PHASES if ms[p] >= 0.005)
    print(f"  {arm:9s} {times['decode_steps']} decode steps, generate {times['wall_s']:.1f} s; "
          f"ms per decode step: {parts}")


def main(argv: list[str]) -> int:
    phases = "--phases" in argv
    args = [a for a in argv if a != "--phases"] or ["--dcp", "4", "--limit", "64"]
    env = {**os.environ, **({"QUAL_PHASE_TIMES": "1"} if phases else {})}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "qual", "run", *args, "--out", str(out), "--history", str(Path(tmp) / "h.sqlite")]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        print(" ".join(["qual", *cmd[3:]]))
        if proc.returncode not in (0, 1):
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        result = json.loads((out / "result.json").read_text())
        for arm in ("control", "candidate"):
            a = result["arms"][arm]
            t = a["throughput"]
            print(f"  {arm:9s} dcp {a['config']['dcp']} tp {a['config']['tp']}: {t['wall_seconds']:6.1f} s, "
                  f"{t['output_tokens']} tokens, {t['tokens_per_second']:.0f} tok/s, acceptance {100 * a['acceptance']['rate']:.2f}%")
        if phases:
            for arm in ("control", "candidate"):
                print_phases(arm, result["arms"][arm]["extra"]["phase_times"])
        target = "; target <= 45 s on 2 cores" if not [a for a in argv if a != "--phases"] else ""  # the default run's
        print(f"total wall time: {wall:.1f} s (exit {proc.returncode}{target})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
