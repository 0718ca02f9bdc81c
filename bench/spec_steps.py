"""Decode steps, and tokens a step, of the toy pair with and without its drafter: what bounds speculative over
plain decoding, whatever the device.

    python3 bench/spec_steps.py [--requests 64] [--batch 8] [--device cpu]

The first --requests HumanEval prompts, 64 new tokens each, at most --batch in flight (a finished request's place
goes to the next waiting one), greedy, at static shapes with async decode (the loop a CUDA run takes), float32.
Speculative over plain at most = (plain steps / spec steps) / (spec step time / plain step time), with the step
times of bench/gpu_bench.py.
"""

from __future__ import annotations

import argparse
import sys

from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import LLMEngine

from gpu_bench import TOY, humaneval_requests  # bench/ is on sys.path when run as a script


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    reqs = humaneval_requests(args.requests)
    longest = max(len(r.prompt_token_ids) for r in reqs)
    steps = {}
    for mode, draft in (("spec", TOY / "draft"), ("plain", None)):
        cfg = EngineConfig(str(TOY / "target"), str(draft) if draft else None, ParallelConfig(1, 1, 1),
                           CacheConfig(block_size=16, memory_bytes=1 << 30), dtype="float32", device=args.device,
                           max_model_len=longest + 64 + 32, phase_times=True, static_shapes=True, async_decode=True,
                           max_num_seqs=args.batch)
        with LLMEngine(cfg) as engine:
            out = engine.generate(reqs, SamplingParams(max_tokens=64, ignore_eos=True))
            steps[mode] = engine.phase_times()["decode_steps"]
        tokens = sum(len(r.output_token_ids) for r in out)
        drafted = sum(r.draft_tokens for r in out)
        rate = f", acceptance {100 * sum(r.accepted_tokens for r in out) / drafted:.2f}%" if drafted else ""
        print(f"{mode}: {len(reqs)} requests, {args.batch} in flight: {tokens} tokens, {steps[mode]} decode steps, "
              f"{(tokens - len(reqs)) / steps[mode]:.2f} tokens a step (the prefill's first tokens aside){rate}")
    print(f"plain steps / spec steps: {steps['plain'] / steps['spec']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
