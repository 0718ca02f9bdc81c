"""Operators one decode step launches, per target layer (a CPU proxy for GPU kernel count).

    python3 bench/op_count.py [--dtype bfloat16] [--layers 4]

Builds a random Qwen3 (toy widths, Qwen3-0.6B's head layout) and profiles one static-shape
decode step (the graph-captured code path) on the CPU. Counts top-level aten operators
that do work: view and metadata operators are not counted. On a GPU each of them is at
least one kernel, and at batch 1 kernel count, not bytes, sets the step time (see
docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from gpu_bench import random_qwen3  # noqa: E402
from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams  # noqa: E402
from qual.runtime.engine import GenerationRequest, LLMEngine  # noqa: E402
from qual.runtime.steps import DecodeStep  # noqa: E402

NO_WORK = {"as_strided", "view", "resolve_conj", "empty", "empty_strided", "_unsafe_view", "result_type", "real",
           "expand", "permute", "reshape", "unsqueeze", "transpose", "t", "slice", "select", "alias", "detach",
           "lift_fresh", "squeeze", "split", "chunk", "narrow", "unbind", "view_as", "empty_like", "flatten",
           "unflatten", "_reshape_alias", "expand_as"}


def count_ops(dtype: str, layers: int) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile

    dims = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                head_dim=16, intermediate_size=512)
    with tempfile.TemporaryDirectory() as tmp:
        path = random_qwen3(Path(tmp) / "m", dims)
        cfg = EngineConfig(str(path), None, ParallelConfig(1, 1, 1), CacheConfig(block_size=16, memory_bytes=1 << 26),
                           dtype=dtype, device="cpu", static_shapes=True, max_model_len=256)
        with LLMEngine(cfg) as engine:
            runner = engine.runner
            engine.generate([GenerationRequest("warm", tuple(range(5, 20)), 4)], SamplingParams(max_tokens=4))
            step = DecodeStep(["x"], [5], [3], [0], [1], {n: torch.zeros((1, 1), dtype=torch.long) for n in runner.geometry})
            inp = runner.decode_inputs(step, pad_to=1, static=True)
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                runner.decode_compute(inp)
    top = [e for e in prof.events() if e.name.startswith("aten::") and e.name[6:] not in NO_WORK
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return collections.Counter(e.name[6:] for e in top)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    ops = count_ops(args.dtype, args.layers)
    total = sum(ops.values())
    print(f"{total} operators in one decode step ({args.dtype}, {args.layers} layers): {total / args.layers:.1f} per layer")
    for name, n in ops.most_common():
        print(f"{n:5d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
