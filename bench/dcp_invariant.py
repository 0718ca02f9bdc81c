"""Decode step time of the toy pair with each DCP merge path: what the invariant merge (dcp_comm invariant) costs.

    python3 bench/dcp_invariant.py [--layouts 1x1,4x4] [--comms a2a,invariant] [--requests 16] [--batch 8]
                                   [--generates 3] [--device cpu] [--threads 1]

Each layout is TPxDCP. The first --requests HumanEval prompts, 64 new tokens each, at most --batch in flight,
greedy, float32, speculative (the toy drafter, K = 7). A decode step's time is the generate's wall time less its
prefill steps, over its decode steps (rank 0's phase times); its CPU time is rank 0's process time over the whole
generate (prefill included), over the same steps: on a shared machine the steadier of the two, and at TP 1 all of
the engine's work. Each the best of --generates generates on one engine. Prints one row per layout and merge path,
with its cost over a2a's at the same layout, and whether the paths chose the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import time

from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import LLMEngine

from gpu_bench import TOY, humaneval_requests  # bench/ is on sys.path when run as a script


def step_ms(tp: int, dcp: int, comm: str, reqs, batch: int, generates: int, device: str, threads: int | None):
    """(best ms per decode step, best rank-0 CPU ms per decode step, decode steps, output tokens) of one engine."""
    longest = max(len(r.prompt_token_ids) for r in reqs)
    cfg = EngineConfig(str(TOY / "target"), str(TOY / "draft"), ParallelConfig(tp, dcp, 1, comm),
                       CacheConfig(block_size=16, memory_bytes=1 << 28), dtype="float32", device=device,
                       max_model_len=longest + 64 + 32, phase_times=True, max_num_seqs=batch, threads_per_rank=threads)
    best, best_cpu = float("inf"), float("inf")
    with LLMEngine(cfg) as engine:
        for _ in range(generates):
            cpu = time.process_time()
            out = engine.generate(reqs, SamplingParams(max_tokens=64))
            cpu = time.process_time() - cpu
            times = engine.phase_times()
            steps = times["decode_steps"]
            best = min(best, 1e3 * (times["wall_s"] - times["seconds"]["prefill"]) / steps)
            best_cpu = min(best_cpu, 1e3 * cpu / steps)
    return best, best_cpu, steps, [r.output_token_ids for r in out]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="1x1,4x4", help="TPxDCP, comma-separated")
    ap.add_argument("--comms", default="a2a,invariant")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--generates", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: the cores over the ranks)")
    args = ap.parse_args()
    reqs = humaneval_requests(args.requests)
    print("| TP | DCP | dcp_comm | ms per decode step | vs a2a | rank 0 CPU ms per step | vs a2a | decode steps | same tokens as a2a |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        tp, dcp = (int(x) for x in layout.split("x"))
        rows = {comm: step_ms(tp, dcp, comm, reqs, args.batch, args.generates, args.device, args.threads or None)
                for comm in args.comms.split(",")}
        base = rows.get("a2a")
        for comm, (ms, cpu, steps, tokens) in rows.items():
            vs = (lambda i, x: f"{100 * (x / base[i] - 1):+.1f}%" if base else "n/a")  # noqa: E731
            same = "n/a" if base is None else ("yes" if tokens == base[3] else "no")
            print(f"| {tp} | {dcp} | {comm} | {ms:.1f} | {vs(0, ms)} | {cpu:.1f} | {vs(1, cpu)} | {steps} | {same} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
