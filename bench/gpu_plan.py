"""Every measurement the open GPU work needs, as named steps one command runs, so that a device call of at most 600 s
loses nothing it finished:

    python3 bench/gpu_plan.py --out-dir $OUT [--steps glm-tests,dcp-tests,...] [--budget 560] [--list]

The steps (STEPS below): the GLM numerics modes on the GPU (glm-*: docs/glm5.md), the DCP-invariant merge on one GPU
(dcp-*: docs/dcp.md), the batch-1 speculative row settled over repeats (settle), and the fused-layer / gluon-layer
route (gpu-tests, chain, e2e-*, toy-spec: docs/PERFORMANCE.md). Each is one command in its own process (a failing
step leaves the GPU to the next); its output goes to OUT/<step>.log as it prints, its numbers to OUT/<step>.json
(bench/gpu_bench.py and bench/skinny_gemm_sweep.py rewrite it whole after every row), a run's folder to OUT/<step>,
tests' junit to OUT/<step>.xml; OUT/steps.json records each step's exit status and wall seconds as it ends. With
--budget, a step starts only if its estimate fits the seconds left, and is stopped at them (exit 124): the call ends
inside its limit with steps.json written, and the next call names the steps left. Standard library only.
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

GLM_RUN = [PY, "-m", "qual", "run", "--model", "glm-toy-vllm", "--dcp", "1", "--device", "cuda", "--limit", "64",
           "--out", "OUT", "--history", "HISTORY"]
DCP_BENCH = [PY, "bench/dcp_invariant.py", "--device", "cuda", "--layouts", "1x1", "--threads", "0"]

# name -> (the estimate of its wall seconds on one H100, what it measures, its command: OUT is the step's output
# (file or folder, output() below), HISTORY one history for the plan's runs). The estimates of the route's steps are
# docs/PERFORMANCE.md's ("`fused-layer` and `gluon-layer`: built, not yet timed on a GPU"), the others from the CPU
# runs' sizes: none of these has run yet.
STEPS = {
    "glm-tests": (200, "the GLM runtime's CUDA cases: FP8 and the vLLM numerics pieces, the indexer (DSA), the "
                       "runtime and the configuration matrix on the GPU (issue 58)",
                  [PY, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/test_glm5_fp8.py",
                   "tests/test_glm5_dsa.py", "tests/test_glm5_runtime.py", "tests/test_glm5_matrix.py", "-k", "cuda",
                   "--junitxml", "OUT"]),
    **{f"glm-{mode}": (110, f"glm-toy-vllm's acceptance per position under --numerics {mode}, 64 HumanEval requests "
                            "(issue 58)", [*GLM_RUN, "--numerics", mode]) for mode in ("exact", "vllm", "vllm-hopper")},
    "dcp-tests": (100, "the DCP-invariant merge's GPU half: DCP 1 against DCP N's shard math bit for bit (issue 59)",
                  [PY, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", "gpu",
                   "tests/test_dcp_invariant.py",
                   "--junitxml", "OUT"]),
    "dcp-bench": (60, "a decode step's time with dcp_comm a2a and invariant, the toy pair, one GPU (issue 59)",
                  DCP_BENCH),
    "dcp-bench-glm": (60, "the same, the GLM-shaped toy pair (issue 59)", [*DCP_BENCH, "--model", "glm-toy"]),
    "settle": (100, "the toy pair's batch-1 compiled speculative row over 20 repeats: which of 72.5 / 80.8 / 84.6% of "
                    "its bound holds (issue 60)",
               [PY, "bench/gpu_bench.py", "--models", "", "--backends", "compiled+compiled-prefill", "--no-hf",
                "--batches", "1", "--steps-per-launch", "4", "--repeats", "20", "--out", "OUT"]),
    "gpu-tests": (300, "fused-layer's and gluon-layer's products against float64, decode graphs equal eager and the "
                       "per-layer path's tokens (26 tests)",
                  [PY, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider", "tests/test_gpu.py",
                   "-k", "fused_layer or gluon_layer", "--junitxml", "OUT"]),
    "chain": (150, "the products in decode order, 32 layers and the LM head, one graph, 1 / 8 rows, against the copy "
                   "bandwidth: split-K with PDL, fused-layer with and without (and with PDL's launch after the weight "
                   "stream), "
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


def output(name: str, out_dir: Path) -> Path:
    """Where the step's OUT points: junit for tests, a run's folder for `qual run`, else the bench's JSON."""
    cmd = STEPS[name][2]
    return out_dir / (f"{name}.xml" if "pytest" in cmd else name if "qual" in cmd else f"{name}.json")


def command(name: str, out_dir: Path) -> list[str]:
    """The step's command, OUT its own output under out_dir, HISTORY the plan's one history there."""
    where = {"OUT": str(output(name, out_dir)), "HISTORY": str(out_dir / "history.sqlite")}
    return [where.get(arg, arg) for arg in STEPS[name][2]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", type=Path, help="where each step's log, numbers and steps.json go")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help=f"comma list, run in this order (default: {','.join(STEPS)})")
    ap.add_argument("--budget", type=float, help="seconds this command may take: a step starts only if its estimate "
                                                  "fits what is left, and is stopped there")
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
    start = time.perf_counter()
    for name in names:
        left = None if args.budget is None else args.budget - (time.perf_counter() - start)
        if left is not None and left < STEPS[name][0]:
            why = f"{left:.0f} s left of --budget, the step takes ~{STEPS[name][0]} s"
            done[name] = {"rc": None, "not_started": why}
            write_json(args.out_dir / "steps.json", done)
            print(f"{name}: not started ({done[name]['not_started']})", flush=True)
            continue
        print(f"{name}: started (~{STEPS[name][0]} s)", flush=True)
        t = time.perf_counter()
        with open(args.out_dir / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(command(name, args.out_dir), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=left).returncode
            except subprocess.TimeoutExpired:  # what it wrote so far stays (rows are written as they finish)
                rc = 124
        done[name] = {"rc": rc, "wall_s": round(time.perf_counter() - t, 1)}
        write_json(args.out_dir / "steps.json", done)
        print(f"{name}: exit {rc} in {done[name]['wall_s']} s", flush=True)
    return 0 if all(d["rc"] == 0 for d in done.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
