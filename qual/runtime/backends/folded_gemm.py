"""The split-K GEMM with the work between a decoder layer's products folded into its loads of x (`folded-norms`).

Between two products of a decode step there is one small kernel: the partial sums of the product before, the
residual add and the RMS norm (or SwiGLU) that make the next product's input. On the 8B shape at batch 1 those
are 1-6 us kernels that each run on a few SMs while the rest idle, and with the gaps between them they are most of
the step's time outside its products (docs/PERFORMANCE.md, "8B shape"). Here the consumer product does that work
on the slice of x each of its programs reads anyway:

- `resid`: x = RMSNorm(h + sum of the product before's partials) * ln. The norm's 1/rms needs the whole row, which
  no program of a split-K product reads, so it is deferred: each program multiplies its slice of (h + partials) * ln
  into its partials, the programs of the first column block also write that slice of the new residual and its
  sum of squares, and whoever sums this product's partials multiplies by 1/rms (`rstd`, an elementwise op that
  torch.compile fuses into the sum it follows anyway).
- `swiglu`: x = SiLU(gate) * up, gate and up being a resid product's partials (the MLP's gate/up), scaled by that
  product's 1/rms: the SwiGLU kernel between gate/up and down disappears.

Roundings follow the unfolded path's (a residual add and the partial sums in the stream's dtype, SiLU and its
product too), except the norm's: (h * ln) is rounded before 1/rms is applied, not after. Tests:
tests/test_kernels_interpreted.py (Triton's interpreter on the CPU, against PyTorch) and tests/test_gpu.py.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from qual.runtime.backends import skinny_gemm
from qual.runtime.backends.skinny_gemm import MAX_ROWS, GemmConfig, choose_config

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

RESID, SWIGLU = 1, 2  # what a program computes x from
BLOCK_R = 128  # residual columns a writer handles at a time


if triton is not None:
    # A compiled kernel reads only constexpr globals (the interpreter reads any): the modes as the kernel sees them.
    _RESID, _SWIGLU = tl.constexpr(RESID), tl.constexpr(SWIGLU)

    @triton.jit
    def _folded_kernel(h_ptr, p_ptr, sq_in_ptr, ln_ptr, w_ptr, out_ptr, r_ptr, sq_ptr, M, N, K, k_per_split,
                       stride_wn, norm_width, eps, chunk, writers,
                       MODE: tl.constexpr, SP: tl.constexpr, SQ: tl.constexpr, SQB: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                       EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
        dt = w_ptr.dtype.element_ty  # the stream's dtype: the unfolded path rounds to it between ops
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_lo = pid_s * k_per_split
        if PDL:
            tl.extra.cuda.gdc_wait()  # the partials are the kernel before's output
            tl.extra.cuda.gdc_launch_dependents()
        if MODE == _SWIGLU:  # 1/rms of the gate/up product's input, from its programs' sums of squares
            rs = tl.arange(0, SQB)
            ss = tl.sum(tl.load(sq_in_ptr + rs[:, None] * M + rm[None, :], mask=(rs[:, None] < SQ) & (rm[None, :] < M),
                                other=0.0), axis=0)
            rstd = tl.rsqrt(ss / norm_width + eps)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xm = (rm[:, None] < M) & (rk[None, :] < K)
            if MODE == _RESID:
                part = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
                for p in tl.static_range(SP):
                    part += tl.load(p_ptr + p * M * K + rm[:, None] * K + rk[None, :], mask=xm, other=0.0)
                h = tl.load(h_ptr + rm[:, None] * K + rk[None, :], mask=xm, other=0.0).to(tl.float32)
                r = (h + part.to(dt).to(tl.float32)).to(dt)  # as the unfolded path: the product, then the add, rounded
                x = (r.to(tl.float32) * tl.load(ln_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)[None, :]).to(dt)
            else:  # SWIGLU
                gate = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
                up = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
                for p in tl.static_range(SP):
                    base = p_ptr + p * M * 2 * K + rm[:, None] * 2 * K + rk[None, :]
                    gate += tl.load(base, mask=xm, other=0.0)
                    up += tl.load(base + K, mask=xm, other=0.0)
                g = (gate * rstd).to(dt).to(tl.float32)
                u = (up * rstd).to(dt).to(tl.float32)
                x = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)
            w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
            if EVEN_N and EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0, eviction_policy="evict_first")
            acc += tl.dot(x, tl.trans(w))
        tl.store(out_ptr + pid_s * M * N + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
        # The new residual and its sums of squares, once: after the weights (a store or a row sum in the loop above
        # keeps it from streaming them, 3-8x slower on an H200), each of the first `writers` column blocks its
        # `chunk` of this split's slice
        if MODE == _RESID:
            if pid_n < writers:
                sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
                c_lo = k_lo + pid_n * chunk
                c_hi = tl.minimum(tl.minimum(c_lo + chunk, k_lo + k_per_split), K)
                for c0 in range(c_lo, c_lo + chunk, BLOCK_R):
                    rk = c0 + tl.arange(0, BLOCK_R)
                    xm = (rm[:, None] < M) & (rk[None, :] < c_hi)
                    part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for p in tl.static_range(SP):
                        part += tl.load(p_ptr + p * M * K + rm[:, None] * K + rk[None, :], mask=xm, other=0.0)
                    h = tl.load(h_ptr + rm[:, None] * K + rk[None, :], mask=xm, other=0.0).to(tl.float32)
                    r = (h + part.to(dt).to(tl.float32)).to(dt)
                    tl.store(r_ptr + rm[:, None] * K + rk[None, :], r, mask=xm)
                    rf = r.to(tl.float32)
                    sq += tl.sum(rf * rf, axis=1)
                tl.store(sq_ptr + (pid_s * writers + pid_n) * M + rm, sq, mask=rm < M)


class _Layout(NamedTuple):
    """Who reads and writes what: each split's slice of K, and the column blocks that write the new residual."""
    k_per_split: int
    chunk: int  # of a split's slice, each writer's, a multiple of BLOCK_R
    writers: int  # column blocks writing the residual, each a sum of squares: sums of squares [split * writers, M]

    @classmethod
    def of(cls, n: int, k: int, cfg: GemmConfig) -> "_Layout":
        k_per_split = math.ceil(math.ceil(k / cfg.split) / cfg.block_k) * cfg.block_k
        chunk = BLOCK_R * math.ceil(math.ceil(k_per_split / BLOCK_R) / math.ceil(n / cfg.block_n))
        return cls(k_per_split, chunk, math.ceil(k_per_split / chunk))


def _launch(mode: int, h, parts, sq_in, ln, w, norm_width: int, eps: float, pdl: bool, cfg: GemmConfig | None = None):
    """(partials [split, M, N], new residual [M, K] or None, sums of squares [split * writers, M] or None)."""
    n, k = w.shape
    m = parts.shape[1] if mode == SWIGLU else h.shape[0]
    if m > MAX_ROWS or w.stride(1) != 1:
        raise ValueError(f"folded_gemm: {m} rows, w {tuple(w.shape)} (need M <= {MAX_ROWS}, unit K stride)")
    cfg = cfg or choose_config(n, k)
    lay = _Layout.of(n, k, cfg)
    dev = w.device
    out = torch.empty(cfg.split, m, n, device=dev, dtype=torch.float32)
    resid = mode == RESID
    r = torch.empty(m, k, device=dev, dtype=w.dtype) if resid else out
    sq = torch.empty(cfg.split * lay.writers, m, device=dev, dtype=torch.float32) if resid else out
    grid = (math.ceil(n / cfg.block_n), cfg.split)
    launch = {"launch_pdl": True} if pdl else {}
    sq_rows = 0 if sq_in is None else sq_in.shape[0]
    # Pointers the mode does not read are any live buffer's (an empty CUDA tensor's may be null, which Triton refuses)
    _folded_kernel[grid](h if h is not None else out, parts if parts.numel() else out,
                         sq_in if sq_in is not None else out, ln if ln is not None else w, w, out, r, sq,
                         m, n, k, lay.k_per_split, w.stride(0), norm_width, eps, lay.chunk, lay.writers,
                         MODE=mode, SP=parts.shape[0], SQ=sq_rows, SQB=triton.next_power_of_2(max(sq_rows, 1)),
                         BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_R=BLOCK_R,
                         EVEN_N=n % cfg.block_n == 0,
                         EVEN_K=k % (cfg.split * cfg.block_k) == 0, PDL=pdl, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, **launch)
    return out, (r if resid else None), (sq if resid else None)


def resid_partials(h: torch.Tensor, parts: torch.Tensor, ln: torch.Tensor, w: torch.Tensor, pdl: bool = False,
                   cfg: GemmConfig | None = None):
    """For r = h + parts.sum(0) (each rounded to h's dtype, as the unfolded residual add): (float32 partials
    [split, M, N] whose sum times rstd(r) is RMSNorm(r) * ln @ w.T, r [M, K], float32 sums of squares of r
    [split * writers, M] for rstd). h [M, K] in w's dtype; parts float32 [P, M, K] (P may be 0: r = h)."""
    return _launch(RESID, h.contiguous(), parts.contiguous(), None, ln, w, h.shape[1], 0.0, pdl, cfg)


def swiglu_partials(gate_up: torch.Tensor, sq: torch.Tensor, norm_width: int, eps: float, w: torch.Tensor,
                    pdl: bool = False, cfg: GemmConfig | None = None) -> torch.Tensor:
    """float32 partials [split, M, N] whose sum is SiLU(gate) * up @ w.T, gate and up the halves of
    gate_up.sum(0) * rstd (gate_up: a resid_partials product's [P, M, 2K]; sq its sums of squares, of a row
    norm_width wide)."""
    return _launch(SWIGLU, None, gate_up.contiguous(), sq.contiguous(), None, w, norm_width, eps, pdl, cfg)[0]


def rstd(sq: torch.Tensor, norm_width: int, eps: float) -> torch.Tensor:
    """[M, 1]: 1/rms of the rows whose sums of squares resid_partials gave, as RMSNorm computes it."""
    return torch.rsqrt(sq.sum(0) / norm_width + eps)[:, None]


if triton is not None:
    # As custom ops torch.compile keeps each launch as one opaque node and fuses the sums and scales around it.
    @torch.library.custom_op("qual::folded_resid", mutates_args=())
    def _resid_op(h: torch.Tensor, parts: torch.Tensor, ln: torch.Tensor, w: torch.Tensor,
                  pdl: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return resid_partials(h, parts, ln, w, pdl)

    @_resid_op.register_fake
    def _(h, parts, ln, w, pdl):
        cfg, m = choose_config(w.shape[0], h.shape[1]), h.shape[0]
        writers = _Layout.of(w.shape[0], h.shape[1], cfg).writers
        return (h.new_empty(cfg.split, m, w.shape[0], dtype=torch.float32), h.new_empty(m, h.shape[1], dtype=w.dtype),
                h.new_empty(cfg.split * writers, m, dtype=torch.float32))

    @torch.library.custom_op("qual::folded_swiglu", mutates_args=())
    def _swiglu_op(gate_up: torch.Tensor, sq: torch.Tensor, norm_width: int, eps: float, w: torch.Tensor,
                   pdl: bool) -> torch.Tensor:
        return swiglu_partials(gate_up, sq, norm_width, eps, w, pdl)

    @_swiglu_op.register_fake
    def _(gate_up, sq, norm_width, eps, w, pdl):
        split = choose_config(w.shape[0], gate_up.shape[2] // 2).split
        return gate_up.new_empty(split, gate_up.shape[1], w.shape[0])


class Ops(NamedTuple):
    """What a target's folded forward calls (qual/runtime/models/qwen3.py), pdl bound."""

    resid: Callable  # (h, parts, ln, w) -> (partials, r, sums of squares)
    swiglu: Callable  # (gate_up partials, sums of squares, norm width, eps, w) -> partials
    partials: Callable  # (x, w) -> partials: the unfolded split-K product (the o projection's)
    rstd: Callable  # (sums of squares, norm width, eps) -> [M, 1]


def ops(pdl: bool) -> Ops:
    return Ops(lambda h, parts, ln, w: _resid_op(h, parts, ln, w, pdl),
               lambda gate_up, sq, width, eps, w: _swiglu_op(gate_up, sq, width, eps, w, pdl),
               lambda x, w: skinny_gemm.partials_op(x, w, pdl), rstd)
