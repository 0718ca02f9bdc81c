"""Host time of the decode loop under cProfile: the toy pair over the first requests of its corpus, one engine.

    .venv/bin/python bench/host_profile.py [--limit 16] [--device cpu|cuda] [--dcp 1] [--top 25]

Prints ms per decode step spent in ModelRunner.decode_inputs (its cumulative time, profiler overhead included),
the phase times, and the top functions by cumulative time. The same host code runs on CUDA; there, the
readback phase also holds the wait for the step's device work.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

from qual.corpus.loader import load_corpus
from qual.profiles import load_profile
from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.cuda_graphs import DEFAULT_SIZES
from qual.runtime.engine import GenerationRequest, LLMEngine
from qual.tokenize import PromptTokenizer


def toy_requests(limit: int) -> tuple[object, list[GenerationRequest]]:
    """The toy profile and its corpus's first `limit` prompts, tokenized as qual run does."""
    profile = load_profile("toy")
    tok = PromptTokenizer(profile.tokenizer_path)
    corpus = load_corpus(profile.corpus)
    reqs = [GenerationRequest(r.id, tuple(tok.encode(r.prompt)), r.max_tokens or profile.max_tokens, r.category)
            for r in corpus.requests[:limit]]
    return profile, reqs


def function_ms(stats: pstats.Stats, name: str) -> float:
    """Cumulative ms of every function called `name` (all files)."""
    return 1e3 * sum(v[3] for (_, _, fn), v in stats.stats.items() if fn == name)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dcp", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--static", action="store_true", help="the CUDA graphs' padded static shapes, eagerly (CPU)")
    args = ap.parse_args(argv)
    profile, reqs = toy_requests(args.limit)
    cuda = args.device.startswith("cuda")
    cfg = EngineConfig(profile.target_path, profile.draft_path, ParallelConfig(args.dcp, args.dcp),
                       CacheConfig(), num_speculative_tokens=profile.num_speculative_tokens, dtype=profile.dtype,
                       max_model_len=profile.max_model_len, device=args.device, cuda_graph_sizes=DEFAULT_SIZES if cuda else None,
                       static_shapes=args.static, phase_times=True)
    sampling = SamplingParams(max_tokens=profile.max_tokens)
    with LLMEngine(cfg) as engine:
        engine.generate(reqs[:2], sampling)  # warm-up: first-call costs out of the profile
        prof = cProfile.Profile()
        prof.enable()
        out = engine.generate(reqs, sampling)
        prof.disable()
        phases = engine.phase_times()
    steps = max(1, phases["decode_steps"])
    stats = pstats.Stats(prof)
    tokens = sum(len(r.output_token_ids) for r in out)
    accepted = sum(r.accepted_tokens for r in out) / max(1, sum(r.draft_tokens for r in out))
    print(f"{len(out)} requests, {tokens} tokens, {steps} decode steps, acceptance {100 * accepted:.2f}%")
    for fn in ("decode_inputs", "_decode", "_choose"):
        print(f"  {fn}: {function_ms(stats, fn) / steps:.3f} ms per decode step (under cProfile)")
    print("  phases (ms per decode step): " + ", ".join(f"{p} {v:.3f}" for p, v in phases["ms_per_step"].items() if v >= 0.0005))
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.print_callees("decode_inputs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
