"""Every measurement issue 60's route needs next on a GPU, in one command that a device call of at most 600 s can run
and lose nothing it finished:

    python3 bench/route_bench.py --out-dir $OUT [--steps gpu-tests,chain,...] [--list]

Each step is one command (STEPS below, in the order they run: correctness before timing, the products alone before
the steps end to end); its output goes to OUT/<step>.log as it prints, its numbers to OUT/<step>.json, rewritten
whole after every row (bench/gpu_bench.py and bench/skinny_gemm_sweep.py write each row as it finishes), and
OUT/steps.json records each step's exit status and wall seconds when it ends. A call killed at its limit therefore
returns every finished row of the step it was in, and the steps before it whole; the next call names the steps left
with --steps. Standard library only: it starts the other scripts, each in its own process (a failing step leaves
the GPU to the next).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SPLIT_K = "compiled+triton-gemm+triton-attention"
FUSED = "compiled+triton-gemm+fused-layer+triton-attention"
GLUON = "compiled+triton-gemm+gluon-layer+triton-attention"
E2E = ["bench/gpu_bench.py", "--models", "8b-shape", "--batches", "1,8", "--no-spec", "--no-hf", "--kernels"]

# name -> (the estimate of its wall seconds on one H100, what it measures, its command with OUT for the step's
# --out file). The estimates are docs/PERFORMANCE.md's ("The route's GPU calls"): none of these has run yet.
STEPS = {
    "gpu-tests": (300, "fused-layer's and gluon-layer's products against float64, decode graphs equal eager and the "
                       "per-layer path's tokens (26 tests)",
                  [PY, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider", "tests/test_gpu.py",
                   "-k", "fused_layer or gluon_layer", "--junitxml", "OUT"]),
    "chain": (150, "the products in decode order, 32 layers and the LM head, one graph, 1 / 8 rows, against the copy "
                   "bandwidth: split-K with PDL, fused-layer with and without (and with PDL's launch after the weight stream), "
                   "Gluon finishing products, gluon-layer",
              [PY, "bench/skinny_gemm_sweep.py", "--shape", "8b-shape", "--no-sweep", "--chain", "--out", "OUT",
               "--variants", "kernel+pdl;fused-layer;fused-layer+pdl;fused-layer+pdl, late launch;"
                             "gluon finished+pdl;gluon fused-layer+pdl"]),
    "e2e-gluon": (360, "8B shape plain decode end to end, batch 1 / 8, kernels a step by group, the peer beside: "
                       "split-K, then gluon-layer, both with pdl",
                  [PY, *E2E, "--peer", "--out", "OUT", "--backends", f"{SPLIT_K}+pdl,{GLUON}+pdl"]),
    "e2e-fused": (300, "the same, split-K then fused-layer, both with pdl (no peer)",
                  [PY, *E2E, "--out", "OUT", "--backends", f"{SPLIT_K}+pdl,{FUSED}+pdl"]),
    "e2e-no-pdl": (420, "the same three without pdl (a finishing product launched early loads nothing before its wait: "
                        "the plain-Triton one may do better without)",
                   [PY, *E2E, "--out", "OUT", "--backends", f"{SPLIT_K},{GLUON},{FUSED}"]),
    "toy-spec": (240, "the toy pair's batch-1 speculative and kept-full stream rows through fused-layer (its 32-wide "
                      "heads: gluon-layer refuses them)",
                 [PY, "bench/gpu_bench.py", "--models", "", "--no-hf", "--batches", "1", "--steps-per-launch", "4",
                  "--stream", "64", "--prefill-ahead", "7", "--out", "OUT", "--backends",
                  "compiled+compiled-prefill,compiled+compiled-prefill+fused-layer+triton-attention+pdl"]),
}


def write_json(path: Path, value) -> None:
    """path's whole new text or its old one, never a part: a process killed at its limit mid-write keeps the rows
    before (written to a temporary file beside it, then renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str))
    tmp.replace(path)


def command(name: str, out_dir: Path) -> list[str]:
    """The step's command, its OUT placeholder the step's own file under out_dir."""
    suffix = ".xml" if name == "gpu-tests" else ".json"
    return [str(out_dir / f"{name}{suffix}") if arg == "OUT" else arg for arg in STEPS[name][2]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", type=Path, help="where each step's log, numbers and steps.json go")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help=f"comma list, run in this order (default: {','.join(STEPS)})")
    ap.add_argument("--list", action="store_true", help="print each step's estimate, purpose and command, run nothing")
    args = ap.parse_args()
    names = [s for s in args.steps.split(",") if s]
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        raise SystemExit(f"--steps: unknown {unknown} (known: {', '.join(STEPS)})")
    if args.list:
        for name in names:
            est, what, _ = STEPS[name]
            print(f"{name}: ~{est} s on one H100: {what}\n  {' '.join(command(name, Path('OUT')))}")
        print(f"total ~{sum(STEPS[n][0] for n in names)} s")
        return 0
    if args.out_dir is None:
        raise SystemExit("--out-dir is required (or --list)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    done = {}
    for name in names:
        print(f"{name}: started (~{STEPS[name][0]} s)", flush=True)
        t = time.perf_counter()
        with open(args.out_dir / f"{name}.log", "w") as log:
            rc = subprocess.run(command(name, args.out_dir), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode  # each line as printed
        done[name] = {"rc": rc, "wall_s": round(time.perf_counter() - t, 1)}
        write_json(args.out_dir / "steps.json", done)
        print(f"{name}: exit {rc} in {done[name]['wall_s']} s", flush=True)
    return 0 if all(d["rc"] == 0 for d in done.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
