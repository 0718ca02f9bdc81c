"""Skinny products of the Qwen3-0.6B decode step: cuBLAS vs the split-K Triton kernel (qual/runtime/kernels).

    python3 bench/gemv_bench.py [--out gemv.json] [--sweep]

Runs on CUDA. Each product is timed as 50 back-to-back calls captured in one CUDA graph, as inside a
decode step, for M = 1 and 8 rows. The calls cycle through copies of the weight that together exceed
the L2 cache three times over, so every call reads its weight from HBM as a decode step does (the
first sweep, 2026-11-30, reused one copy: its numbers were L2-warm). Prints microseconds per call and the weight bytes read per second for
cuBLAS (F.linear on w [out, in]; and x @ w.T made contiguous [in, out]), the kernel with the runtime's
choose_config (its float32 partials summed and cast, as the runtime does), and with --sweep the best of
a grid of configurations (kernel alone).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import replay_seconds  # noqa: E402  (gpu_bench puts the repository on sys.path)

from qual.runtime.kernels import skinny_gemm  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}
SWEEP = [skinny_gemm.GemmConfig(bn, bk, s, w, st) for bn, bk, s, w, st in
         itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8, 16), (4,), (3,))]


L2_BYTES = 60 << 20  # H200


def graph_us(fn, n: int = 50) -> float:
    """Microseconds per fn(i) call, i = 0..n-1, replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i)
    return replay_seconds(g, 10) * 1e6 / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv.json")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    res = []
    for name, (n_out, n_in) in SHAPES.items():
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * 0.02
        mb = w.numel() * 2 / 1e6
        copies = max(1, -(-3 * L2_BYTES // (w.numel() * 2)))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        wts = [c.t().contiguous() for c in ws]
        pick = lambda i: ws[i % copies]  # noqa: E731
        for m in (1, 8):
            x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w).float()
            got = skinny_gemm.partials(x, w).sum(0)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            row = {"name": name, "m": m, "MB": mb, "rel_err": err,
                   "cublas_us": graph_us(lambda i: F.linear(x, pick(i))),
                   "cublas_nn_us": graph_us(lambda i: x @ wts[i % copies]),
                   "config": str(skinny_gemm.choose_config(n_out, n_in)),
                   "triton_us": graph_us(lambda i: skinny_gemm.partials(x, pick(i)).sum(0).to(x.dtype))}
            if args.sweep and name != "lm_head":
                times = []
                for cfg in SWEEP:
                    try:
                        times.append((graph_us(lambda i: skinny_gemm.partials(x, pick(i), cfg)), cfg))
                    except Exception as exc:  # a config the compiler rejects (registers, shared memory)
                        print(f"  {cfg}: {type(exc).__name__}", file=sys.stderr)
                best = min(times, key=lambda t: t[0])
                row |= {"best_us": best[0], "best_config": str(best[1]),
                        "top5": [(round(t, 2), str(c)) for t, c in sorted(times, key=lambda t: t[0])[:5]]}
            res.append(row)
            tb = lambda us: mb / us  # noqa: E731  (MB/us = TB/s)
            line = (f"{name:8s} M={m} {mb:6.1f} MB  cuBLAS {row['cublas_us']:7.2f} us {tb(row['cublas_us']):5.2f} TB/s"
                    f"  (NN {row['cublas_nn_us']:7.2f})  triton {row['triton_us']:7.2f} us {tb(row['triton_us']):5.2f} TB/s"
                    f"  err {err:.1e}")
            if "best_us" in row:
                line += f"  best {row['best_us']:6.2f} us {tb(row['best_us']):5.2f} TB/s {row['best_config']}"
            print(line, flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
