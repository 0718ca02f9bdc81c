"""Nsight Compute's per-instruction counters of the one-kernel decode step, summed per phase and source line.

    python3 bench/ncu_by_phase.py source-sass.csv [--lines 30]

The input is `ncu -i REPORT --page source --csv --print-source sass` of one _decode_layers_kernel launch (the
0.6B shape, default tiling: what bench/fused_decode_bench.py runs). ncu names only each instruction's innermost
source line, which for a reduction is inside Triton's own library. So the kernel is compiled here the way the
device compiles it (bench/kernel_resources.py; Triton's version must be the device's), its SASS is matched to
ncu's instruction by instruction, and each instruction gets the whole inlined call chain from the PTX line info:
the phase function it ran in and the kernel line. Needs no GPU.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_resources import ROOT, compile_kernel  # noqa: E402

KERNEL = ROOT / "qual/runtime/kernels/decode_layers.py"
COUNTERS = ("Warp Stall Sampling (All Samples)", "L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive",
            "Instructions Executed")


def call_chains(kernel) -> list[list[int]]:
    """Per SASS instruction, in order: the kernel-file lines of its inlined call chain (innermost first)."""
    ptx = kernel.asm["ptx"].splitlines()
    loc, cur = [None] * (len(ptx) + 2), None
    for i, line in enumerate(ptx, 1):
        m = re.search(r"\.loc\s+\d+\s+\d+\s+\d+\s+//\s*(.*)$", line)
        cur = m.group(1) if m else cur
        loc[i] = cur
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
        sass = subprocess.run([str(tool), "-gp", "-c", f.name], capture_output=True, text=True, check=True).stdout
    chains, ptx_line = [], None
    for line in sass.splitlines():
        if m := re.search(r'##\s*File "\.nv_debug_ptx_txt", line (\d+)', line):
            ptx_line = int(m.group(1))
        elif re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line):
            chain = loc[ptx_line] if ptx_line else None
            chains.append([int(x) for x in re.findall(rf"{KERNEL.name}:(\d+):\d+", chain or "")])
    return chains


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--lines", type=int, default=30, help="source lines to list")
    ap.add_argument("--layers", type=int, default=28, help="to give counters per SM per layer")
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    col = {h: k for k, h in enumerate(rows[start])}
    data = [r for r in rows[start + 1:] if len(r) > 2]
    chains = call_chains(compile_kernel(90, 8))
    if len(chains) != len(data):
        raise SystemExit(f"ncu has {len(data)} instructions, this compile {len(chains)}: not the same kernel "
                         "(Triton version, tiling or shape differ)")
    src = KERNEL.read_text().splitlines()
    starts = [(i, m.group(1)) for i, line in enumerate(src, 1) if (m := re.match(r"    def (_\w+)\(", line))]

    def function(line: int) -> str:
        return starts[bisect.bisect_right([s for s, _ in starts], line) - 1][1]

    by_phase, by_line = defaultdict(lambda: [0.0] * 4), defaultdict(lambda: [0.0] * 4)
    for r, chain in zip(data, chains):
        names = [function(x) for x in chain]
        phase = next((n for n in reversed(names) if n != "_decode_layers_kernel"), "kernel body") if chain else "?"
        vals = [float(r[col[c]]) if r[col[c]] not in ("", "-") else 0.0 for c in COUNTERS]
        for acc in (by_phase[phase], by_line[(phase, chain[0] if chain else 0)]):
            for k, v in enumerate(vals):
                acc[k] += v
    total, per = sum(v[0] for v in by_phase.values()) or 1.0, args.sms * args.layers
    print(f"{'phase function':24s} {'stall samples':>13s} {'shared wavefronts':>17s} {'excess':>7s} {'instructions':>12s}"
          "   (per SM per layer)")
    for name, v in sorted(by_phase.items(), key=lambda x: -x[1][0]):
        print(f"{name:24s} {100 * v[0] / total:12.1f}% {v[1] / per:17.0f} {v[2] / per:7.0f} {v[3] / per:12.0f}")
    print()
    for (name, line), v in sorted(by_line.items(), key=lambda x: -x[1][0])[:args.lines]:
        text = src[line - 1].strip()[:70] if line else ""
        print(f"{name[:20]:20s} {line:4d} {100 * v[0] / total:5.1f}% {v[1] / per:6.0f} {v[2] / per:6.0f} {v[3] / per:6.0f}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
