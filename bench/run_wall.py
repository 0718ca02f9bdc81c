"""Wall time of `qual run --dcp 4 --limit 64` on the toy default (the issue-4 CPU target: <= 60 s).

    .venv/bin/python bench/run_wall.py [--dcp 4] [--limit 64] [extra qual run args...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    args = argv or ["--dcp", "4", "--limit", "64"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "qual", "run", *args, "--out", str(out), "--history", str(Path(tmp) / "h.sqlite")]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
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
        print(f"total wall time: {wall:.1f} s (exit {proc.returncode}; target <= 60 s on 2 cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
