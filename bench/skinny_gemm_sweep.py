"""The split-K GEMM's configurations on the Qwen3-0.6B decode projections, against cuBLAS.

    python3 bench/skinny_gemm_sweep.py [--out gemm.json] [--rows 1,8]

Runs on CUDA. Each product is timed as 50 back-to-back calls captured in one CUDA graph, as inside a
decode step. The calls cycle through copies of the weight that together exceed the L2 cache three
times over, so every call reads its weight from HBM as a decode step does. Prints, per projection and
row count: cuBLAS (F.linear), the kernel at `skinny_gemm.choose_config` and the best five of a grid of
configurations (the kernel alone: inside a compiled step the sum of its partials fuses into the next
kernel), each in microseconds and weight bytes read per second.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from qual.runtime.backends import skinny_gemm

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
GRID = [skinny_gemm.GemmConfig(bn, bk, s, w, st) for bn, bk, s, w, st in
        itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16), (4, 8), (3, 4, 5))]
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
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / 10 / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemm.json")
    ap.add_argument("--rows", default="1,8", help="comma list of row counts (batch size x tokens a step)")
    args = ap.parse_args()
    res = []
    for name, (n_out, n_in) in SHAPES.items():
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * 0.02
        mb = w.numel() * 2 / 1e6
        copies = max(1, -(-3 * L2_BYTES // (w.numel() * 2)))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        pick = lambda i: ws[i % copies]  # noqa: E731
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w).float()
            chosen = skinny_gemm.choose_config(n_out, n_in)
            row = {"name": name, "m": m, "MB": mb, "config": str(chosen),
                   "cublas_us": graph_us(lambda i: F.linear(x, pick(i))),
                   "chosen_us": graph_us(lambda i: skinny_gemm.partials(x, pick(i), chosen))}
            times = []
            for cfg in GRID:
                if cfg.block_k * cfg.split > n_in:  # a split with no whole K block
                    continue
                try:
                    got = skinny_gemm.partials(x, w, cfg).sum(0)
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    if err > 1e-2:
                        raise ValueError(f"relative error {err:.1e}")
                    times.append((graph_us(lambda i: skinny_gemm.partials(x, pick(i), cfg)), cfg))
                except Exception as exc:  # a config the compiler rejects (registers, shared memory)
                    print(f"  {cfg}: {type(exc).__name__}", file=sys.stderr)
            times.sort(key=lambda t: t[0])
            row["best"] = [(round(t, 2), str(c)) for t, c in times[:5]]
            res.append(row)
            tb = lambda us: mb / us  # noqa: E731  (MB/us = TB/s)
            print(f"{name:8s} M={m:<2d} {mb:5.1f} MB  cuBLAS {row['cublas_us']:6.2f} us {tb(row['cublas_us']):4.2f} TB/s"
                  f"  chosen {row['chosen_us']:6.2f} us {tb(row['chosen_us']):4.2f} TB/s {chosen}", flush=True)
            for t, c in times[:5]:
                print(f"    {t:6.2f} us {tb(t):4.2f} TB/s  {c}", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
