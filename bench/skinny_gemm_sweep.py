"""The split-K GEMM's configurations on a model shape's decode projections, against cuBLAS; and a decode step's
chain of products with and without programmatic dependent launch (PDL).

    python3 bench/skinny_gemm_sweep.py [--out gemm.json] [--rows 1,8] [--shape qwen3-0.6b-shape|8b-shape]
                                       [--chain] [--no-sweep] [--gluon-sweep] [--variants "A;B"]

Runs on CUDA. Each product is timed as back-to-back calls captured in one CUDA graph, as inside a decode step.
The calls cycle through copies of the weight that together exceed the L2 cache three times over, so every call
reads its weight from HBM as a decode step does. Prints, per projection and row count: cuBLAS (F.linear), the
kernel at `skinny_gemm.choose_config` and the best five of a grid of configurations (a coarse grid, then warps and
stages around its best three; the kernel alone: inside a compiled step the sum of its partials fuses into the next
kernel), each in microseconds and weight bytes read per second.

--chain: every layer's four products and the LM head of the shape (all layers' own weights, as a decode step reads
them), each product's input made from the one before's output by a small kernel (as a compiled step's norms and
activations are), captured in one graph: cuBLAS; the kernel (at the sweep's best configurations, or with
--no-sweep at choose_config's); the same with PDL (the small kernel waits where it first reads, as inductor's do);
each also with fixed inputs and no small kernels between (products only); and `finished` / `finished+pdl`: products
that sum their own split-K partials (the last program of each column block to finish, counted atomically) and
write the next product's bf16 input, no kernel between (what taking the small kernels into the products' stores
could reach, norms and activations left out); `fused-layer` / `fused-layer+pdl`: the fused-layer backend part's
products (qual/runtime/backends/fused_layer.py), which also do the norms, RoPE, the KV write, the residual and
SwiGLU (attention, between qkv and o in a step, left out), and `fused-layer+pdl, late launch`: the same letting the
next product launch after their last weight tile's load is issued instead of at their start; `gluon
fused-layer+pdl`: the gluon-layer part's (qual/runtime/backends/gluon_layer.py). Each against the copy bandwidth.
Where Triton has Gluon, the same variants with qual/runtime/backends/gluon_gemm.py's product (TMA ring, producer
warp: its weight tiles issued before the PDL wait), plus `gluon+pdl, early glue`: small kernels that let the next
product launch before their own wait, so that its weight stream may start while the product before still runs
(inductor's kernels let it launch after their loads). --gluon-sweep times the Gluon kernel's configurations per
projection first (gluon_sweep).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from qual.files import write_text  # whole or not at all: a call killed mid-write keeps the rows before
from qual.runtime.backends import fused_layer, gluon_gemm, gluon_layer, skinny_gemm
from qual.runtime.backends.gluon_gemm import GluonConfig
from qual.runtime.backends.skinny_gemm import GemmConfig

SHAPES = {  # name -> (N, K) of w [N, K]
    "qwen3-0.6b-shape": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "8b-shape": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                 "lm_head": (128256, 4096)},
}
LAYERS = {"qwen3-0.6b-shape": 28, "8b-shape": 32}
HEADS = {"qwen3-0.6b-shape": (16, 8), "8b-shape": (32, 8)}  # query and KV heads of 128 (the fused-layer variants)
COARSE = [GemmConfig(bn, bk, s) for bn, bk, s in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16))]
REFINE = [(w, st) for w, st in itertools.product((4, 8), (3, 4, 6))]
L2_BYTES = 60 << 20  # H200


def graph_us(fn, n: int) -> float:
    """Microseconds per fn(i) call, i = 0..n-1, replayed from one CUDA graph (median of 7 replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i)
    g.replay()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    del g
    return sorted(times)[3]


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (median of 20)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    times = []
    for _ in range(22):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / sorted(times[2:])[10]


def sweep(shapes: dict, rows: list[int], res: dict) -> dict:
    """Per (projection, rows): cuBLAS, the chosen configuration and the grid's best; returns the best configs."""
    best = {}
    for name, (n_out, n_in) in shapes.items():
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * 0.02
        mb = w.numel() * 2 / 1e6
        copies = max(1, -(-3 * L2_BYTES // (w.numel() * 2)))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        calls = max(4, min(50, int(400 / mb)))  # ~400 MB a replay
        pick = lambda i: ws[i % copies]  # noqa: E731
        for m in rows:
            x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w).float()
            chosen = skinny_gemm.choose_config(n_out, n_in)
            row = {"name": name, "m": m, "MB": mb, "config": str(chosen),
                   "cublas_us": graph_us(lambda i: F.linear(x, pick(i)), calls),
                   "chosen_us": graph_us(lambda i: skinny_gemm.partials(x, pick(i), chosen), calls)}

            def timed(cfgs):
                out = []
                for cfg in cfgs:
                    if cfg.block_k * cfg.split > n_in:  # a split with no whole K block
                        continue
                    try:
                        got = skinny_gemm.partials(x, w, cfg).sum(0)
                        err = ((got - ref).abs().max() / ref.abs().max()).item()
                        if err > 1e-2:
                            raise ValueError(f"relative error {err:.1e}")
                        out.append((graph_us(lambda i: skinny_gemm.partials(x, pick(i), cfg), calls), cfg))
                    except Exception as exc:  # a config the compiler rejects (registers, shared memory)
                        print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
                return out

            times = sorted(timed(COARSE), key=lambda t: t[0])
            refined = {replace(c, num_warps=wp, num_stages=st) for _, c in times[:3] for wp, st in REFINE}
            times = sorted(times + timed(refined - {c for _, c in times}), key=lambda t: t[0])
            row["best"] = [(round(t, 2), str(c)) for t, c in times[:5]]
            best[name, m] = times[0][1]
            res["sweep"].append(row)
            tb = lambda us: mb / us  # noqa: E731  (MB/us = TB/s)
            print(f"{name:8s} M={m:<2d} {mb:6.1f} MB  cuBLAS {row['cublas_us']:7.2f} us {tb(row['cublas_us']):4.2f} TB/s"
                  f"  chosen {row['chosen_us']:7.2f} us {tb(row['chosen_us']):4.2f} TB/s {chosen}", flush=True)
            for t, c in times[:5]:
                print(f"    {t:7.2f} us {tb(t):4.2f} TB/s  {c}", flush=True)
    return best


@triton.jit
def _glue_kernel(parts_ptr, out_ptr, S, M, N, n_take, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """out[M, n_take] = sum over S of parts[S, M, N][:, :n_take], in bf16: a compiled step's small kernel between
    two products (with PDL it waits before its first read, and lets the next kernel launch after its loads, as
    inductor's kernels do; EARLY: before its wait, so that the next product may start its weight stream while the
    product before this kernel still runs)."""
    row, blk = tl.program_id(0), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_take
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(S):
        acc += tl.load(parts_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
    if PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row * n_take + cols, (acc * 0.01).to(tl.bfloat16), mask=ok)


def glue(parts: torch.Tensor, n_take: int, pdl: bool, early: bool = False) -> torch.Tensor:
    S, M, N = parts.shape
    out = torch.empty(M, n_take, device=parts.device, dtype=torch.bfloat16)
    _glue_kernel[(M, triton.cdiv(n_take, 1024))](parts, out, S, M, N, n_take, BLOCK=1024, PDL=pdl, EARLY=early,
                                                 **({"launch_pdl": True} if pdl else {}))
    return out


@triton.jit
def _reduced_kernel(x_ptr, w_ptr, part_ptr, cnt_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """The split-K product that finishes its own output: each program stores its float32 partial, and the last of a
    column block's SPLIT programs to arrive (an atomic count, reset for the next launch) sums them and writes
    out[M, N] in bf16 (scaled as the glue kernel's), so the next product reads it with no kernel between."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    acc, rm, rn = skinny_gemm.split_k_tile(x_ptr, w_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_N,
                                           BLOCK_K, EVEN_N, EVEN_K, PDL)
    tile = rm[:, None] * N + rn[None, :]
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        tl.store(out_ptr + tile, (acc * 0.01).to(tl.bfloat16), mask=ok)
    else:
        tl.store(part_ptr + pid_s * M * N + tile, acc, mask=ok)
        tl.debug_barrier()  # every thread's share stored before the count says this program is done
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the others' partials are all stored: sum them (from L2, not a stale L1)
            tl.debug_barrier()
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(part_ptr + s * M * N + tile, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tile, (total * 0.01).to(tl.bfloat16), mask=ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


def reduced(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, cfg: GemmConfig | None = None,
            pdl: bool = False) -> torch.Tensor:
    """bf16 [M, N] = 0.01 * x @ w.T through _reduced_kernel (x [M, K], rows of any stride; counts: int32 zeros, one
    a column block at least, left zero)."""
    m, k = x.shape
    n = w.shape[0]
    cfg = cfg or skinny_gemm.choose_config(n, k)
    k_per_split = skinny_gemm.split_width(k, cfg)
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    parts = torch.empty(cfg.split, m, n, device=x.device, dtype=torch.float32) if cfg.split > 1 else out
    launch = {"launch_pdl": True} if pdl else {}
    _reduced_kernel[(triton.cdiv(n, cfg.block_n), cfg.split)](
        x, w, parts, counts, out, m, n, k, k_per_split, x.stride(0), w.stride(0), SPLIT=cfg.split,
        BLOCK_M=skinny_gemm.MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % (cfg.split * cfg.block_k) == 0, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch)
    return out


# The Gluon kernel's grid around choose_config's: tile shapes and ring depths that fit two programs an SM
GLUON_TILES = [(128, 64, 4), (128, 64, 6), (64, 64, 6), (64, 128, 4), (128, 128, 3), (256, 64, 3)]


def gluon_sweep(shapes: dict, rows: list[int], res: dict) -> dict:
    """Per (projection, rows): the Gluon kernel at choose_config and over GLUON_TILES x splits (choose_config's
    for the tile, half and double), against the split-K kernel at its choose_config; returns the best configs."""
    best = {}
    for name, (n_out, n_in) in shapes.items():
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * 0.02
        mb = w.numel() * 2 / 1e6
        copies = max(1, -(-3 * L2_BYTES // (w.numel() * 2)))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        calls = max(4, min(50, int(400 / mb)))
        pick = lambda i: ws[i % copies]  # noqa: E731
        cfgs = []
        for bn, bk, st in GLUON_TILES:
            base = gluon_gemm.choose_config(n_out, n_in, bn, bk, st)
            for split in sorted({base.split, max(1, base.split // 2), base.split * 2}):
                if split <= -(-n_in // bk):
                    cfgs.append(GluonConfig(bn, bk, split, st))
        for m in rows:
            x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w).float()
            row = {"name": name, "m": m, "MB": mb, "split_k_us": graph_us(lambda i: skinny_gemm.partials(x, pick(i)), calls)}
            times = []
            for cfg in cfgs:
                try:
                    got = gluon_gemm.partials(x, w, cfg).sum(0)
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    if err > 1e-2:
                        raise ValueError(f"relative error {err:.1e}")
                    times.append((graph_us(lambda i: gluon_gemm.partials(x, pick(i), cfg), calls), cfg))
                except Exception as exc:
                    print(f"  gluon {cfg}: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr, flush=True)
            times.sort(key=lambda t: t[0])
            row["gluon_best"] = [(round(t, 2), str(c)) for t, c in times[:5]]
            res["gluon_sweep"].append(row)
            tb = lambda us: mb / us  # noqa: E731  (MB/us = TB/s)
            print(f"{name:8s} M={m:<2d} {mb:6.1f} MB  split-K {row['split_k_us']:7.2f} us "
                  f"{tb(row['split_k_us']):4.2f} TB/s", flush=True)
            for t, c in times[:3]:
                print(f"    gluon {t:7.2f} us {tb(t):4.2f} TB/s  {c}", flush=True)
            if times:
                best[name, m] = times[0][1]
    return best


def chain(shape: str, rows: list[int], best: dict, bw: float, res: dict, gluon_best: dict | None = None,
          only: list[str] | None = None, save=lambda: None) -> None:
    """A decode step's products in order, every layer's own weights, small kernels between: one graph replay (save:
    called after each row)."""
    shapes = SHAPES[shape]
    order = ["qkv", "o", "gate_up", "down"]
    layers = [{p: torch.randn(*shapes[p], device="cuda", dtype=torch.bfloat16) * 0.02 for p in order}
              for _ in range(LAYERS[shape])]
    head = torch.randn(*shapes["lm_head"], device="cuda", dtype=torch.bfloat16) * 0.02 if "lm_head" in shapes else None
    wbytes = sum(t.numel() * 2 for lay in layers for t in lay.values()) + (head.numel() * 2 if head is not None else 0)
    hidden = shapes["o"][0]
    take = {"qkv": shapes["o"][1], "o": hidden, "gate_up": shapes["down"][1], "down": hidden}  # the next input's width

    def step(product, pdl: bool, link: str):
        """One decode step's products, each input made from the output before by a small kernel (link "glue"; "early
        glue": one that lets the next product launch before its own wait), read from it directly ("direct": a product
        that finishes its own bf16 output), or fixed ("fixed")."""
        def run(m):
            x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
            fixed = {p: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for p, (_, k) in shapes.items()}

            def one(_):
                h = x
                for lay in layers:
                    for p in order:
                        out = product(fixed[p] if link == "fixed" else h, lay[p], p, m)
                        if link in ("glue", "early glue"):
                            h = glue(out, take[p], pdl, early=link == "early glue")
                        elif link == "direct":
                            h = out[:, :take[p]]  # the next product's rows: a strided view
                if head is not None:
                    product(fixed["lm_head"] if link == "fixed" else h, head, "lm_head", m)
            return one
        return run

    def cublas(h, w, p, m):  # bf16 [1, M, N]: the glue kernel sums it as one partial
        return F.linear(h, w)[None]

    def kernel(pdl: bool, swept: bool = True):
        def f(h, w, p, m):
            cfg = best.get((p, m)) if swept else None  # None: choose_config
            return skinny_gemm.partials(h, w, cfg, pdl=pdl)
        return f

    narrowest = min(c.block_n for c in COARSE)  # a count a column block, at any configuration the sweep picks
    counts = torch.zeros(max(triton.cdiv(n, narrowest) for n, _ in shapes.values()), device="cuda", dtype=torch.int32)

    def finishing(pdl: bool):
        def f(h, w, p, m):
            return reduced(h, w, counts, best.get((p, m)), pdl)
        return f

    gluon_best = gluon_best or {}

    def gluon(pdl: bool):
        def f(h, w, p, m):
            return gluon_gemm.partials(h, w, gluon_best.get((p, m)), pdl=pdl)
        return f

    heads, kv_heads = HEADS[shape]
    slots = torch.randperm(4096, device="cuda")[:16]  # rows' KV slots, scattered
    cache = torch.zeros(4096, kv_heads, 128, device="cuda", dtype=torch.bfloat16)
    norm = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    head_norm = torch.ones(heads + kv_heads, 128, device="cuda", dtype=torch.bfloat16)
    inv_freq, residual = torch.rand(64, device="cuda"), torch.randn(16, hidden, device="cuda", dtype=torch.bfloat16)
    layer_counts = {p: torch.zeros(1024, device="cuda", dtype=torch.int32) for p in order}

    def fused_layer_products(pdl: bool, late_launch: bool = False):
        """qual/runtime/backends/fused_layer.py's products: qkv with the input norm, q/k norm, RoPE and the KV write;
        o and down with the residual; gate/up with the norm and SwiGLU; the LM head as the split-K kernel. late_launch:
        each lets the next kernel launch after its weight stream is issued (ProductConfig.late_launch)."""
        def cfg(choose, *shape):
            return replace(choose(*shape), late_launch=late_launch)

        def f(h, w, p, m):
            n, k = w.shape
            if p == "qkv":
                return fused_layer.qkv_product(h, norm, 1e-6, w, head_norm, slots[:m], inv_freq, slots[:m], cache,
                                               cache, heads, kv_heads, layer_counts[p],
                                               cfg(fused_layer.qkv_config, n, k, 128), pdl=pdl)
            if p == "gate_up":
                return fused_layer.swiglu_product(h, norm, 1e-6, w, layer_counts[p],
                                                  cfg(fused_layer.swiglu_config, n, k), pdl=pdl)
            if p in ("o", "down"):
                return fused_layer.residual_product(h, w, residual[:m], layer_counts[p],
                                                    cfg(fused_layer.residual_config, n, k), pdl=pdl)
            return skinny_gemm.partials(h, w, pdl=pdl)
        return f

    def gluon_fused_layer_products(pdl: bool):
        """gluon-layer's products (qual/runtime/backends/gluon_layer.py): o and down also write x * ln for the next
        normed product, which reads it beside the raw residual (kept here between calls)."""
        raw = {}

        def f(h, w, p, m):
            if p == "qkv":
                return gluon_layer.qkv_product(h, raw.get(m, h), 1e-6, w, head_norm, slots[:m], inv_freq,
                                                     slots[:m], cache, cache, heads, kv_heads, layer_counts[p], pdl=pdl)
            if p == "gate_up":
                return gluon_layer.swiglu_product(h, raw.get(m, h), 1e-6, w, layer_counts[p], pdl=pdl)
            if p in ("o", "down"):
                raw[m], x_ln = gluon_layer.residual_product(h, w, residual[:m], layer_counts[p], norm, pdl=pdl)
                return x_ln
            return gluon_gemm.partials(h, w, gluon_best.get((p, m)), pdl=pdl)
        return f

    def gluon_finishing(pdl: bool):
        def f(h, w, p, m):
            return gluon_gemm.finished(h, w, counts, scale=0.01, cfg=gluon_best.get((p, m)), pdl=pdl)
        return f

    variants = {"cublas": (cublas, False, "glue")}
    if best:
        variants["chosen"] = (kernel(False, swept=False), False, "glue")
    variants.update({
        "kernel": (kernel(False), False, "glue"),
        "kernel, products only": (kernel(False), False, "fixed"),
        "kernel+pdl": (kernel(True), True, "glue"),
        "kernel+pdl, products only": (kernel(True), True, "fixed"),
        # each product sums its own split-K partials (its last program of a column block): no kernel between
        "finished": (finishing(False), False, "direct"),
        "finished+pdl": (finishing(True), True, "direct"),
        # the fused-layer backend part's products, their epilogues whole (norms, RoPE, KV write, residual, SwiGLU)
        "fused-layer": (fused_layer_products(False), False, "direct"),
        "fused-layer+pdl": (fused_layer_products(True), True, "direct"),
        # the same, each product letting the next launch only once its weight stream is issued (not at its start)
        "fused-layer+pdl, late launch": (fused_layer_products(True, late_launch=True), True, "direct"),
    })
    if gluon_gemm.available():
        variants.update({
            "gluon": (gluon(False), False, "glue"),
            "gluon, products only": (gluon(False), False, "fixed"),
            "gluon+pdl": (gluon(True), True, "glue"),
            "gluon+pdl, early glue": (gluon(True), True, "early glue"),
            "gluon+pdl, products only": (gluon(True), True, "fixed"),
            "gluon finished": (gluon_finishing(False), False, "direct"),
            "gluon finished+pdl": (gluon_finishing(True), True, "direct"),
            "gluon fused-layer+pdl": (gluon_fused_layer_products(True), True, "direct"),
        })
    unknown = set(only or ()) - set(variants)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)} (known: {', '.join(variants)})")
    variants = {k: v for k, v in variants.items() if not only or k in only}
    print(f"chain: {LAYERS[shape]} layers x {order} + lm_head, {wbytes / 1e9:.2f} GB of weights; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for m in rows:
        for name, (product, pdl, link) in variants.items():
            try:
                us = graph_us(step(product, pdl, link)(m), 1)
            except Exception as exc:
                print(f"  M={m} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                res["chain"].append({"m": m, "variant": name, "error": f"{type(exc).__name__}: {exc}"})
                save()
                continue
            frac = wbytes / (us * 1e-6) / bw
            res["chain"].append({"m": m, "variant": name, "us": us, "weight_bw_over_copy_bw": frac})
            save()
            print(f"  M={m:<2d} {name:28s} {us:8.1f} us  {wbytes / us / 1e6:5.2f} TB/s  {100 * frac:5.1f}% of copy",
                  flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemm.json")
    ap.add_argument("--rows", default="1,8", help="comma list of row counts (batch size x tokens a step)")
    ap.add_argument("--shape", default="qwen3-0.6b-shape", choices=sorted(SHAPES))
    ap.add_argument("--chain", action="store_true", help="also the decode step's chain of products (see above)")
    ap.add_argument("--no-sweep", action="store_true", help="chain only, at the chosen configurations")
    ap.add_argument("--variants", help="';'-separated: only these chain variants (names hold commas; default: all)")
    ap.add_argument("--gluon-sweep", action="store_true", help="also sweep the Gluon kernel's configurations (its "
                    "chain variants then run at their best; else at gluon_gemm.choose_config's)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(0), "copy_bandwidth_Bps": bw, "sweep": [], "gluon_sweep": [], "chain": [],
           "pdl_available": skinny_gemm.pdl_available()}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; PDL available: {res['pdl_available']}", flush=True)
    best = {} if args.no_sweep else sweep(SHAPES[args.shape], rows, res)
    res["best"] = {f"{p}/m{m}": str(c) for (p, m), c in best.items()}
    save = lambda: write_text(args.out, json.dumps(res, indent=2, default=str))  # noqa: E731  (after each row)
    save()
    gluon_best = gluon_sweep(SHAPES[args.shape], rows, res) if args.gluon_sweep and gluon_gemm.available() else {}
    res["gluon_best"] = {f"{p}/m{m}": str(c) for (p, m), c in gluon_best.items()}
    save()
    if args.chain:
        chain(args.shape, rows, best, bw, res, gluon_best, args.variants.split(";") if args.variants else None,
              save=save)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
