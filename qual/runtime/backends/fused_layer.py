"""A Qwen3 decode layer of <= 16 rows as four split-K products that finish their own output (backend part
`fused-layer`).

Where triton-gemm leaves float32 partial sums to inductor's small kernels (sum, residual, RMSNorm, q/k norm, RoPE,
the KV write, SwiGLU: 450 µs of the 4.555 ms batch-1 8B step without pdl, docs/PERFORMANCE.md's CUPTI row), each
product here ends in the work that follows it, so no kernel sits between two products except attention:

1. qkv: x's RMSNorm taken into the product, then per head (head_dim is one column block) q/k RMSNorm, RoPE, and
   the paged KV write; returns the roped queries.
2. o: the residual added; returns the new residual.
3. gate/up: x's RMSNorm taken into the product, and SwiGLU: a column block holds BLOCK_N / 2 gate rows and the
   matching BLOCK_N / 2 up rows (interleaved at the tile's load by row index, so the weights are read in place,
   no second copy); returns silu(gate) * up.
4. down: the residual added; returns the new residual.

The K loop is triton-gemm's (skinny_gemm.split_k_tile, the norm at the load and the gate/up row pairs its
options). Split-K: `split` programs share a column block; each stores its float32 partial, and the last to arrive
(an atomic count a column block, acquire-release) sums them in split order and runs the epilogue, then sets the
count back to zero, so the next launch and a CUDA graph's replay find it zero. With split 1 every program finishes
its own block.

The input RMSNorm: its weight is applied to x's tile as it is loaded (float32 product, rounded once to the
weights' dtype for the tensor cores), and 1/rms, a factor a row, after the K sum: the product is linear in x, so
sum_k (x_k ln_k / rms) w_nk = (sum_k x_k ln_k w_nk) / rms. The finishing program computes 1/rms from the whole
input row (8 KB at hidden 4096) itself; the other programs of its block never need it. Folding ln into the weights
at load was not chosen: it costs a second copy of qkv and gate/up (the per-layer path for prefill reads the
unfolded ones) and one more bf16 rounding of every weight; applied at the load it rounds x * ln once, where the
PyTorch path rounds the normed row and then its product with the weight (two roundings).

The products run as custom ops for a model's layers: qual/runtime/backends/layer_products.py.

Every epilogue computes in float32 and rounds once, at its store: nearer float64 than the PyTorch path, which
rounds the product, the norm, cos/sin and each RoPE term to bf16 (tests/test_kernels_interpreted.py measures both
against float64).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from qual.runtime.backends.skinny_gemm import MAX_ROWS, TARGET_PROGRAMS, split_width

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

RESIDUAL, QKV, SWIGLU = 0, 1, 2  # the epilogues


@dataclass(frozen=True)
class ProductConfig:
    """One fused product's tiling: block_n columns (qkv: head_dim, one head), block_k of K a step, split programs
    a column block. late_launch (with PDL): each program lets the next kernel launch after its last weight tile's
    load is issued instead of at its start (bench/skinny_gemm_sweep.py's chain selects it; no backend does)."""

    block_n: int = 64
    block_k: int = 128
    split: int = 1
    num_warps: int = 4
    num_stages: int = 4
    late_launch: bool = False


def choose_config(n: int, k: int, block_n: int = 64, block_k: int = 128, num_warps: int = 4) -> ProductConfig:
    """Split K until at least TARGET_PROGRAMS programs run, keeping >= 2 K blocks a program and at most 8 splits
    (the finishing program reads every partial of its block)."""
    blocks = math.ceil(n / block_n)
    split = 1
    while blocks * split < TARGET_PROGRAMS and split < 8 and k // (split * 2) >= 2 * block_k:
        split *= 2
    return ProductConfig(block_n, block_k, split, num_warps)


# Each product's tile, chosen by its sm_90 compile (tests/test_kernels_compile.py), not yet by a GPU's clock: at
# most 64 registers a thread (the split-K kernel's most) and 62 KB of shared memory a program, nothing spilled. The
# products with the norm prologue take 8 warps (4 warps: 94 registers for gate/up's 64 x 128 tile, 138 for qkv's
# 128 x 128); qkv's column block is a head.
def qkv_config(n: int, k: int, head_dim: int) -> ProductConfig:
    return choose_config(n, k, block_n=head_dim, block_k=64, num_warps=8)


def swiglu_config(two_i: int, k: int) -> ProductConfig:
    return choose_config(two_i, k, num_warps=8)


def residual_config(n: int, k: int) -> ProductConfig:
    return choose_config(n, k)


def _interpreted() -> bool:
    """Triton's CPU interpreter: its bfloat16 tl.dot is wrong (its fp16 one is not), so bf16 tiles are multiplied
    as float32 there (the same exact products, summed in float32 as the tensor cores do)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    from qual.runtime.backends.skinny_gemm import split_k_tile  # its K loop, with the norm at the load and gate/up

    @triton.jit
    def _fused_product_kernel(
            x_ptr, w_ptr, ln_ptr, part_ptr, cnt_ptr, res_ptr, out_ptr,
            qkn_ptr, pos_ptr, inv_freq_ptr, slot_ptr, k_ptr, v_ptr,
            M, N, K, k_per_split, w_half, stride_xm, stride_wn, stride_rm, stride_om, cache_slot_stride, eps, head_eps,
            SPLIT: tl.constexpr, NORM: tl.constexpr, EPI: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
            EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, LATE_LAUNCH: tl.constexpr):
        """Program (n, s): column block n over the s-th k_per_split of K; the block's last program to finish runs
        the epilogue EPI on the whole sum (see the module docstring)."""
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        HALF: tl.constexpr = BLOCK_N // 2
        j = tl.arange(0, BLOCK_N)
        # SwiGLU (EPI 2): the tile's first half gate rows, its second the matching up rows (up at w_half)
        acc, rm, _ = split_k_tile(x_ptr, w_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                                  EVEN_N, EVEN_K, PDL, ln_ptr, w_half, NORM, EPI == 2, UPCAST, LATE_LAUNCH)
        tile = rm[:, None] * (tl.num_programs(0) * BLOCK_N) + (pid_n * BLOCK_N + j)[None, :]
        finish = True
        if SPLIT > 1:
            tl.store(part_ptr + pid_s * M * tl.num_programs(0) * BLOCK_N + tile, acc, mask=rm[:, None] < M)
            tl.debug_barrier()  # every thread's share stored before the count says this program is done
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            finish = arrived == SPLIT - 1
            if finish:  # the others' partials are all stored: sum them in split order (from L2, not a stale L1)
                tl.debug_barrier()
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT):
                    acc += tl.load(part_ptr + s * M * tl.num_programs(0) * BLOCK_N + tile, mask=rm[:, None] < M,
                                   other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + pid_n, 0)  # zero for the next launch (and a graph's replay)
        if finish:
            if NORM:  # 1/rms of each input row, from the whole row
                ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    rk = k0 + tl.arange(0, BLOCK_K)
                    xr = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                                 mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0).to(tl.float32)
                    ss += tl.sum(xr * xr, axis=1)
                acc = acc * tl.rsqrt(ss / K + eps)[:, None]
            row_ok = rm < M
            if EPI == 0:
                cols = pid_n * BLOCK_N + j
                ok = row_ok[:, None] & (cols < N)[None, :]
                res = tl.load(res_ptr + rm[:, None] * stride_rm + cols[None, :], mask=ok, other=0.0)
                tl.store(out_ptr + rm[:, None] * stride_om + cols[None, :],
                         (acc + res.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)
            else:
                # the block's two halves [BLOCK_M, HALF]: gate and up, or a head's rotate-half pair
                lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
                h = tl.arange(0, HALF)
                if EPI == 2:
                    cols = pid_n * HALF + h
                    ok = row_ok[:, None] & (cols < w_half)[None, :]
                    act = lo / (1.0 + tl.exp(-lo)) * hi
                    tl.store(out_ptr + rm[:, None] * stride_om + cols[None, :], act.to(out_ptr.dtype.element_ty),
                             mask=ok)
                else:
                    _qkv_epilogue(lo, hi, h, rm, row_ok, pid_n, out_ptr, stride_om, qkn_ptr, pos_ptr,
                                  inv_freq_ptr, slot_ptr, k_ptr, v_ptr, cache_slot_stride, head_eps, NH, NKV, BLOCK_N,
                                  HALF)

    @triton.jit
    def _cos_sin(angle):
        """cos and sin of float32 angles in plain arithmetic: tl.cos and tl.sin compile to libdevice's, whose slow
        path for large arguments keeps 28 B of local memory (a stack). Reduced to [-pi, pi] (2 pi in two parts, the
        first exact in its products with the turns), then Taylor polynomials of the half angle (|h| <= pi / 2: terms
        past the last < 1e-7) and the double angle."""
        turns = tl.floor(angle * 0.15915494309189535 + 0.5)
        r = tl.fma(turns, -6.28125, angle)
        h = 0.5 * tl.fma(turns, -1.9353071795864769e-3, r)
        h2 = h * h
        s = h * (1.0 + h2 * (-1.0 / 6 + h2 * (1.0 / 120 + h2 * (-1.0 / 5040 + h2 * (1.0 / 362880 + h2 * (
            -1.0 / 39916800 + h2 * (1.0 / 6227020800)))))))
        c = 1.0 + h2 * (-0.5 + h2 * (1.0 / 24 + h2 * (-1.0 / 720 + h2 * (1.0 / 40320 + h2 * (-1.0 / 3628800 + h2 * (
            1.0 / 479001600 + h2 * (-1.0 / 87178291200)))))))
        return c * c - s * s, 2.0 * s * c

    @triton.jit
    def _qkv_epilogue(lo, hi, h, rm, row_ok, head, q_ptr, stride_qm, qkn_ptr, pos_ptr, inv_freq_ptr, slot_ptr,
                      k_ptr, v_ptr, cache_slot_stride, head_eps, NH: tl.constexpr, NKV: tl.constexpr,
                      D: tl.constexpr, HALF: tl.constexpr):
        """One head of the qkv product (lo, hi: its two halves): q and k heads RMSNormed and rotated (rotate-half
        RoPE at each row's position), q stored to q_ptr [M, NH * D], k and v written to the caches [slots, NKV, D]
        at each row's slot."""
        ok = row_ok[:, None] & (h < HALF)[None, :]
        slot = tl.load(slot_ptr + rm, mask=row_ok, other=0).to(tl.int64)
        if head < NH + NKV:
            r = tl.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / D + head_eps)[:, None]
            nw = qkn_ptr + head * D  # q_norm's weight for a query head, k_norm's for a key head
            lo = lo * r * tl.load(nw + h).to(tl.float32)[None, :]
            hi = hi * r * tl.load(nw + HALF + h).to(tl.float32)[None, :]
            angle = (tl.load(pos_ptr + rm, mask=row_ok, other=0).to(tl.float32)[:, None]
                     * tl.load(inv_freq_ptr + h)[None, :])
            cos, sin = _cos_sin(angle)
            out_lo = lo * cos - hi * sin
            out_hi = hi * cos + lo * sin
            if head < NH:
                q = q_ptr + rm[:, None] * stride_qm + head * D + h[None, :]
                tl.store(q, out_lo.to(q_ptr.dtype.element_ty), mask=ok)
                tl.store(q + HALF, out_hi.to(q_ptr.dtype.element_ty), mask=ok)
            else:
                kc = k_ptr + slot[:, None] * cache_slot_stride + (head - NH) * D + h[None, :]
                tl.store(kc, out_lo.to(k_ptr.dtype.element_ty), mask=ok)
                tl.store(kc + HALF, out_hi.to(k_ptr.dtype.element_ty), mask=ok)
        else:
            vc = v_ptr + slot[:, None] * cache_slot_stride + (head - NH - NKV) * D + h[None, :]
            tl.store(vc, lo.to(v_ptr.dtype.element_ty), mask=ok)
            tl.store(vc + HALF, hi.to(v_ptr.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, w: torch.Tensor, k: int) -> None:
    if x.shape[0] > MAX_ROWS or x.shape[1] != k or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"fused_layer: x {tuple(x.shape)} w {tuple(w.shape)} (need M <= {MAX_ROWS}, unit K stride)")


def _launch(x, w, counts, cfg: ProductConfig, n_blocks: int, epi: int, out: torch.Tensor, pdl: bool, ln=None,
            eps: float = 0.0, res=None, w_half: int = 0, qkv_args: tuple | None = None) -> None:
    m, k = x.shape
    n = w.shape[0]
    _check(x, w, k)
    if cfg.split > 1 and counts.numel() < n_blocks:
        raise ValueError(f"fused_layer: {counts.numel()} counts for {n_blocks} column blocks")
    k_per_split = split_width(k, cfg)
    parts = torch.empty(cfg.split, m, n_blocks * cfg.block_n, device=x.device, dtype=torch.float32) \
        if cfg.split > 1 else out
    qkn, pos, inv_freq, slots, k_cache, v_cache, head_eps, nh, nkv = qkv_args or (
        out, out, out, out, out, out, 0.0, 1, 1)
    launch = {"launch_pdl": True} if pdl else {}
    _fused_product_kernel[(n_blocks, cfg.split)](
        x, w, x if ln is None else ln, parts, counts, out if res is None else res, out,
        qkn, pos, inv_freq, slots, k_cache, v_cache,
        m, n, k, k_per_split, w_half, x.stride(0), w.stride(0), out.stride(0) if res is None else res.stride(0),
        out.stride(0), k_cache.stride(0), eps, head_eps,
        SPLIT=cfg.split, NORM=ln is not None, EPI=epi, NH=nh, NKV=nkv, BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_N=(w_half % (cfg.block_n // 2) if epi == SWIGLU else n % cfg.block_n) == 0,
        EVEN_K=k % (cfg.split * cfg.block_k) == 0, UPCAST=_interpreted() and x.dtype == torch.bfloat16, PDL=pdl,
        LATE_LAUNCH=cfg.late_launch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch)


def residual_product(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, counts: torch.Tensor,
                     cfg: ProductConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """residual + x @ w.T in x's dtype, summed in float32 and rounded once (x [M, K], w [N, K], residual [M, N];
    counts: int32 zeros, one a column block, left zero)."""
    n, k = w.shape
    cfg = cfg or residual_config(n, k)
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    _launch(x, w, counts, cfg, math.ceil(n / cfg.block_n), RESIDUAL, out, pdl, res=residual)
    return out


def swiglu_product(x: torch.Tensor, ln: torch.Tensor, eps: float, gate_up: torch.Tensor, counts: torch.Tensor,
                   cfg: ProductConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up of RMSNorm(x) * ln, [M, I] in x's dtype (gate_up [2 I, K]: the gate rows, then the up rows,
    as layers.MlpWeights stacks them)."""
    two_i, k = gate_up.shape
    inter = two_i // 2
    cfg = cfg or swiglu_config(two_i, k)
    out = torch.empty(x.shape[0], inter, device=x.device, dtype=x.dtype)
    _launch(x, gate_up, counts, cfg, math.ceil(inter / (cfg.block_n // 2)), SWIGLU, out, pdl, ln=ln, eps=eps,
            w_half=inter)
    return out


def qkv_product(x: torch.Tensor, ln: torch.Tensor, eps: float, qkv: torch.Tensor, qk_norm: torch.Tensor,
                positions: torch.Tensor, inv_freq: torch.Tensor, slots: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, counts: torch.Tensor,
                cfg: ProductConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """Roped, normed queries [M, heads * D] of RMSNorm(x) * ln; the roped, normed keys and the values written to
    k/v_cache [slots, kv heads, D] at slots [M] (routed: every row a slot). qkv [(heads + 2 kv) D, K]; qk_norm
    [heads + kv, D] (q_norm's weight a query head, then k_norm's a key head: layers.AttentionWeights); positions
    [M]; inv_freq [D / 2] float32; the per-head norms take eps too (Qwen3's one rms_norm_eps)."""
    d = qk_norm.shape[1]
    n, k = qkv.shape
    if n != (num_heads + 2 * num_kv_heads) * d or d & (d - 1) or d < 32:
        raise ValueError(f"fused_layer: qkv {tuple(qkv.shape)} for {num_heads}/{num_kv_heads} heads of {d} "
                         "(need a power-of-2 head_dim >= 32: one column block a head)")
    if k_cache.stride(2) != 1 or k_cache.stride(1) != d or v_cache.stride() != k_cache.stride():
        raise ValueError("fused_layer: the KV caches must be [slots, kv heads, D] with contiguous heads")
    cfg = cfg or qkv_config(n, k, d)
    if cfg.block_n != d:
        raise ValueError(f"fused_layer: the qkv product's block_n must be head_dim {d} (got {cfg.block_n})")
    q = torch.empty(x.shape[0], num_heads * d, device=x.device, dtype=x.dtype)
    _launch(x, qkv, counts, cfg, n // d, QKV, q, pdl, ln=ln, eps=eps,
            qkv_args=(qk_norm, positions, inv_freq, slots, k_cache, v_cache, eps, num_heads, num_kv_heads))
    return q

