"""GPU benchmark: what a prefill costs the device, by padded bucket, on the toy pair's kept-full stream.

    python3 bench/prefill_bench.py [--backend pytorch] [--requests 64] [--batch 8] [--prefill-ahead 7] [--no-draft]

Runs the stream of bench/gpu_bench.py (the first --requests HumanEval prompts, at most --batch in flight, 64 new
tokens, bf16) once, so that its prefill chunks capture their buckets (qual/runtime/prefill_graphs.py), then prints
how many chunks each bucket served and how full its rectangles were, and each captured bucket's replay time (the
mean of 20 after 3 warm-ups) with its kernels (CUPTI, one replay). In a stream the decode steps wait behind these
replays; gpu_bench's device split shows their share.
"""

from __future__ import annotations

import argparse
import sys

from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import LLMEngine
from qual.runtime.prefill_graphs import bucket

from gpu_bench import TOY, cuda_kernels, humaneval_requests, mean_seconds  # bench/ is on sys.path when run as a script


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="pytorch")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prefill-ahead", type=int, default=7)
    ap.add_argument("--no-draft", action="store_true", help="the target alone (no draft context written)")
    args = ap.parse_args()
    reqs = humaneval_requests(args.requests)
    longest = max(len(r.prompt_token_ids) for r in reqs)
    cfg = EngineConfig(str(TOY / "target"), None if args.no_draft else str(TOY / "draft"), ParallelConfig(1, 1, 1),
                       CacheConfig(block_size=16, memory_bytes=4 << 30), dtype="bfloat16", device="cuda",
                       cuda_graph_sizes=(args.batch,), max_model_len=longest + 64 + 32, backend=args.backend,
                       max_num_seqs=args.batch, prefill_ahead=args.prefill_ahead)
    with LLMEngine(cfg) as engine:
        graphs = engine.runner.prefill_graphs
        served: dict[tuple[int, int], list[int]] = {}  # bucket -> [chunks, real tokens]
        run = graphs.run

        def counted(prompts, tables):
            b = served.setdefault(bucket(len(prompts), max(map(len, prompts))), [0, 0])
            b[0] += 1
            b[1] += sum(map(len, prompts))
            return run(prompts, tables)

        graphs.run = counted
        engine.generate(reqs, SamplingParams(max_tokens=64, ignore_eos=True))
        del graphs.run
        print(f"{args.backend}, {'target alone' if args.no_draft else 'target + drafter'}: "
              f"{sum(c for c, _ in served.values())} prefill chunks")
        print(f"{'bucket':>8s} {'chunks':>6s} {'full':>5s} {'ms a replay':>11s} {'kernels':>7s} {'kernel us':>9s}")
        for (rows, length), (chunks, real) in sorted(served.items()):
            b = graphs.buckets.get((rows, length))
            ms, n, us = None, 0, 0.0
            if b is not None and b.graph is not None:
                time_us, launches = cuda_kernels(b.graph.replay, 1)
                ms, n, us = 1e3 * mean_seconds(b.graph.replay, 20), round(sum(launches.values())), sum(time_us.values())
            print(f"{rows:>3d}x{length:<4d} {chunks:6d} {real / (chunks * rows * length):5.0%} "
                  f"{ms if ms is not None else float('nan'):11.3f} {n:7d} {us:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
