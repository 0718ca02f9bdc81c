"""Where a decode step's GPU time goes: the kernels of one captured graph, grouped by kind.

    python3 bench/profile_decode.py [--model qwen3-0.6b-shape|toy] [--batch 1] [--compile MODE] [--triton-gemm]
                                    [--triton-attention] [--out prof.json]

Runs on the device machine (CUDA). Builds the engine as bench/gpu_bench.py does, then profiles
20 replays of the batch's decode graph (torch.profiler, CUPTI) and prints, per step: kernel count,
summed kernel time, graph replay time, and the kernels that take the most time.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_bench import QWEN3_0_6B, random_qwen3, replay_seconds, weight_bytes_read  # noqa: E402

from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams  # noqa: E402
from qual.runtime.engine import GenerationRequest, LLMEngine  # noqa: E402

KINDS = [  # first match names the kernel's kind
    ("gemm/gemv", r"gemm|gemv|cutlass|sm90|xmma|nvjet|splitK|Kernel2|_partials_kernel"),
    ("attention", r"_paged_attention_kernel"),
    ("triton (inductor)", r"^triton"),
    ("reduce", r"reduce|softmax|logsumexp|norm"),
    ("index/copy", r"index|gather|scatter|copy|cat|Memcpy|memcpy"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
]


def kind_of(name: str) -> str:
    return next((k for k, pat in KINDS if re.search(pat, name, re.I)), "other")


def profile(path: Path, batch: int, compile_mode: str | None, triton_gemm: bool = False, triton_attention: bool = False,
            steps: int = 20) -> dict:
    cfg = EngineConfig(str(path), None, ParallelConfig(1, 1, 1), CacheConfig(block_size=16, memory_bytes=4 << 30),
                       dtype="bfloat16", device="cuda", cuda_graph_sizes=(batch,), max_model_len=32 + 128 + 32,
                       compile_mode=compile_mode, triton_gemm=triton_gemm, triton_attention=triton_attention)
    with LLMEngine(cfg) as engine:
        g = torch.Generator().manual_seed(1)
        vocab = engine.target_cfg.vocab_size
        reqs = [GenerationRequest(f"r{i}", tuple(torch.randint(0, vocab - 2, (32,), generator=g).tolist()), 16)
                for i in range(batch)]
        engine.generate(reqs, SamplingParams(max_tokens=16, ignore_eos=True))
        graph = engine.runner.graphs.graphs[batch].graph
        step_ms = 1e3 * replay_seconds(graph)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                graph.replay()
            torch.cuda.synchronize()
        wbytes = weight_bytes_read(engine.runner.target, batch)
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rec = per_name[e.name]
            rec[0] += 1
            rec[1] += e.time_range.elapsed_us()
    kernels = sorted(((n, c / steps, us / steps) for n, (c, us) in per_name.items()), key=lambda r: -r[2])
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for n, c, us in kernels:
        kinds[kind_of(n)][0] += c
        kinds[kind_of(n)][1] += us
    return {"graph_step_ms": step_ms, "kernels_per_step": sum(c for _, c, _ in kernels),
            "kernel_us_per_step": sum(us for _, _, us in kernels), "weight_bytes_read": wbytes,
            "by_kind": {k: {"count": c, "us": round(us, 1)} for k, (c, us) in sorted(kinds.items(), key=lambda x: -x[1][1])},
            "top": [{"name": n[:120], "count": c, "us": round(us, 2)} for n, c, us in kernels[:25]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b-shape", choices=["qwen3-0.6b-shape", "toy"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--compile", default=None, metavar="MODE", help="torch.compile mode for the decode step")
    ap.add_argument("--triton-gemm", action="store_true", help="decode projections through the split-K Triton kernel")
    ap.add_argument("--triton-attention", action="store_true", help="target attention through the Triton kernel")
    ap.add_argument("--out", default="prof.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = random_qwen3(Path(tmp) / "m", QWEN3_0_6B) if args.model != "toy" else ROOT / "models/toy/target"
        res = profile(path, args.batch, args.compile, args.triton_gemm, args.triton_attention)
    res |= {"model": args.model, "batch": args.batch, "compile": args.compile, "triton_gemm": args.triton_gemm,
            "triton_attention": args.triton_attention}
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"{args.model} batch {args.batch} compile {args.compile} triton_gemm {args.triton_gemm} "
          f"triton_attention {args.triton_attention}: graph step {res['graph_step_ms']:.3f} ms, "
          f"{res['kernels_per_step']:.0f} kernels, kernel time {res['kernel_us_per_step'] / 1e3:.3f} ms")
    for k, v in res["by_kind"].items():
        print(f"  {k:20s} {v['count']:6.0f} kernels {v['us'] / 1e3:8.3f} ms")
    for t in res["top"][:15]:
        print(f"  {t['us']:9.1f} us {t['count']:5.0f}x  {t['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
