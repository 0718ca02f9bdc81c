"""Host work per decode step: the engine's and the rank's own time, with the device's share taken away.

    python3 bench/host_loop.py [--batch 8] [--requests N] [--plain] [--steps-per-launch 1] [--prefill-ahead 0]
                               [--generates 30] [--profile]

The toy pair on the CPU at static shapes with async decode (the loop a CUDA run takes), the first --requests
HumanEval prompts (default: --batch of them), at most --batch in flight (a finished request's row goes to the next
one), 64 new tokens. Each step's compute (and each prefill bucket's) is replaced by its first result for that shape, so
what is timed is scheduling, the step's inputs, commit and readback: the host work that sets the pace where a
device step is shorter than it (compiled steps: docs/PERFORMANCE.md). Tokens are not the model's (every step
commits what the first one chose), and a first result read from KV blocks that no real step wrote depends on
which blocks a request got: two versions of the code that hand out blocks differently can run different numbers
of steps, so compare them by their generates' times, not per step. Prints the best and the mean generate's microseconds per decode step (the
mean holds the garbage collector's passes, which land in some generates only; its full walks of the heap alive at
the engine's start no longer do: qual/runtime/heap.py) and the phases.
--profile: cProfile of further generates, by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

from qual.runtime import model_runner, prefill_graphs
from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import LLMEngine

from gpu_bench import TOY, humaneval_requests  # bench/ is on sys.path when run as a script


def first_result(fn, key):
    """fn with its result kept per key(args): computed once per shape, then returned as it is."""
    kept = {}

    def wrapped(*args):
        k = key(*args)
        if k not in kept:
            kept[k] = fn(*args)
        return kept[k]
    return wrapped


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--requests", type=int, help="HumanEval prompts a generate runs (default: --batch)")
    ap.add_argument("--plain", action="store_true", help="no drafter: plain decoding")
    ap.add_argument("--steps-per-launch", type=int, default=1)
    ap.add_argument("--prefill-ahead", type=int, default=0, help="requests held ready (EngineConfig.prefill_ahead)")
    ap.add_argument("--generates", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    model_runner.ModelRunner.static_run = first_result(model_runner.ModelRunner.static_run,
                                                       lambda runner, step_args, feats, n: (step_args.numel, n))
    prefill_graphs.PrefillGraphs._compute = first_result(prefill_graphs.PrefillGraphs._compute,
                                                         lambda graphs, b: (b.rows, b.length))
    reqs = humaneval_requests(args.requests or args.batch)
    cfg = EngineConfig(str(TOY / "target"), None if args.plain else str(TOY / "draft"), ParallelConfig(1, 1, 1),
                       CacheConfig(block_size=16, memory_bytes=1 << 30), dtype="float32", device="cpu",
                       max_model_len=max(len(r.prompt_token_ids) for r in reqs) + 64 + 32, static_shapes=True,
                       async_decode=True, phase_times=True, max_num_seqs=args.batch,
                       steps_per_launch=args.steps_per_launch, prefill_ahead=args.prefill_ahead)
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    with LLMEngine(cfg) as engine:
        engine.generate(reqs, sp)  # every shape's first result
        walls = []
        for _ in range(args.generates):
            t = time.perf_counter()
            engine.generate(reqs, sp)
            walls.append(time.perf_counter() - t)
        phases = engine.phase_times()
        steps = phases["decode_steps"]
        best, mean = min(walls), sum(walls) / len(walls)
        print(f"batch {args.batch}, {len(reqs)} requests, {'plain' if args.plain else 'spec'}: {args.generates} generates, "
              f"best {1e3 * best:.3f} ms, mean {1e3 * mean:.3f} ms, {steps} decode steps: {1e6 * best / steps:.1f} us "
              f"a step (best), {1e6 * mean / steps:.1f} (mean); last generate's phases, us a step: "
              + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in phases["ms_per_step"].items() if v)
              + f"; launches ahead that left the tables on the device: {engine.tables_kept} of {sum(engine.launches.values())}")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.generates):
                engine.generate(reqs, sp)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
