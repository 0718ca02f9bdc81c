"""The backend part gluon-layer: the fused-layer products (qual/runtime/backends/fused_layer.py) in Gluon, on
gluon_gemm's product core (a producer warp streams the weight through a TMA ring, its first pass issued before the
PDL wait; a consumer warp group multiplies on the tensor cores), finished by the same epilogues. The model-facing
side (custom ops, GluonLayerProducts): qual/runtime/backends/gluon_layer_products.py.

What differs from the plain-Triton products, because the x tiles reach the tensor cores by TMA, never through
registers:
- the input RMSNorm's weight cannot multiply x's tile at its load. The residual product that writes x (o or down)
  writes x * ln_next beside it (`ln_next`: the next norm's weight, x rounded first, then one rounding), and the next
  product streams that; its finishing program computes 1/rms from the raw residual row and scales the sum, as the
  Triton products do. The first layer's x * ln is one elementwise kernel before it;
- a TMA tile is contiguous rows of w, so gate/up's stage is two half tiles (gluon_gemm._issue_weight): block_n / 2
  gate rows and the matching up rows, each by its own TMA copy from the [gate; up] weight in place (no copy of the
  weights, as the Triton product gathers the rows at each tile's load).
The finishing program (the last of a column block, by an atomic count set back to zero) stores the block's sum to
its float32 scratch and reads it back in halves in a blocked layout for the epilogue (RoPE pairs a head's halves);
qkv's epilogue is fused_layer._qkv_epilogue itself, a @triton.jit function called from the Gluon kernel.
Triton's interpreter does not run Gluon: tests/test_kernels_compile.py compiles it for sm_90 with the GPU image's
Triton, tests/test_gpu.py checks it against float64 on a GPU.
"""

from __future__ import annotations

import math

import torch

from qual.runtime.backends import fused_layer, gluon_gemm
from qual.runtime.backends.fused_layer import QKV, RESIDUAL, SWIGLU  # the epilogues, numbered as fused_layer's
from qual.runtime.backends.gluon_gemm import MAX_REGISTERS, GluonConfig, check_operands, tiles_per_split

gl = gluon_gemm.gl if gluon_gemm.gluon is not None else None

if gl is not None:
    gluon = gluon_gemm.gluon

    @gluon.jit
    def _fused_kernel(w_desc, x_desc, part_ptr, cnt_ptr, xr_ptr, stride_xr, res_ptr, out_ptr, stride_o, ln_ptr,
                      out2_ptr, qkn_ptr, pos_ptr, inv_freq_ptr, slot_ptr, k_ptr, v_ptr, M, N, K, w_half,
                      cache_slot_stride, eps, TILES: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                      EPI: gl.constexpr, NORM: gl.constexpr, LN_NEXT: gl.constexpr, NH: gl.constexpr,
                      NKV: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
        PAIR: gl.constexpr = EPI == 2  # gate/up: w_desc's tiles are half tiles, a gate block's and its up block's
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0] * (2 if PAIR else 1)
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        R: gl.constexpr = x_desc.block_type.shape[0]
        HALF: gl.constexpr = BLOCK_N // 2
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, R, 16])
        pid_n, pid_s = gl.program_id(0), gl.program_id(1)
        n0 = pid_n * BLOCK_N
        w_row = n0
        if PAIR:
            w_row = pid_n * HALF
        acc = gluon_gemm._product(w_desc, x_desc, w_row, pid_s * TILES * BLOCK_K, TILES, STAGES, PDL, acc_layout,
                                  w_half, PAIR)
        NT = gl.num_programs(0) * BLOCK_N  # the scratch's width: whole column blocks
        rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        rm = gl.arange(0, R, layout=gl.SliceLayout(0, acc_layout))
        tile = rm[None, :] * NT + rn[:, None]  # acc is the product transposed: [columns, rows]
        ok = (rm[None, :] < M) & (rn[:, None] < NT)
        last = True
        if SPLIT > 1:
            gl.store(part_ptr + pid_s * M * NT + tile, acc, mask=ok)
            gl.thread_barrier()  # every thread's share stored before the count says this program is done
            arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            last = arrived == SPLIT - 1
        if last:
            if SPLIT > 1:  # the others' partials are all stored: sum them in split order (from L2)
                gl.thread_barrier()
                acc = gl.zeros([BLOCK_N, R], gl.float32, acc_layout)
                for s in range(SPLIT):
                    acc += gl.load(part_ptr + s * M * NT + tile, mask=ok, other=0.0, cache_modifier=".cg")
                gl.atomic_xchg(cnt_ptr + pid_n, 0)  # zero for the next launch (and a graph's replay)
            gl.store(part_ptr + tile, acc, mask=ok)  # the block's sum, read back below in halves
            gl.thread_barrier()
            L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
            rows = gl.arange(0, R, layout=gl.SliceLayout(1, L))
            h = gl.arange(0, HALF, layout=gl.SliceLayout(0, L))
            row_ok = rows < M
            half = part_ptr + rows[:, None] * NT + (n0 + h)[None, :]  # .cg: from L2, where the store above went
            lo = gl.load(half, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            hi = gl.load(half + HALF, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            if NORM:  # 1/rms of each raw input row
                ss = gl.zeros([R], gl.float32, gl.SliceLayout(1, L))
                c = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
                for k0 in range(0, K, 128):
                    xr = gl.load(xr_ptr + rows[:, None] * stride_xr + (k0 + c)[None, :],
                                 mask=row_ok[:, None] & ((k0 + c) < K)[None, :], other=0.0).to(gl.float32)
                    ss += gl.sum(xr * xr, axis=1)
                inv = gl.rsqrt(ss / K + eps)[:, None]
                lo = lo * inv
                hi = hi * inv
            if EPI == 0:
                _residual_half(lo, n0 + h, rows, row_ok, N, res_ptr, out_ptr, stride_o, ln_ptr, out2_ptr, LN_NEXT)
                _residual_half(hi, n0 + HALF + h, rows, row_ok, N, res_ptr, out_ptr, stride_o, ln_ptr, out2_ptr,
                               LN_NEXT)
            elif EPI == 2:
                cols = pid_n * HALF + h
                m = row_ok[:, None] & (cols < w_half)[None, :]
                act = lo / (1.0 + gl.exp(-lo)) * hi
                gl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], act.to(out_ptr.dtype.element_ty), mask=m)
            else:
                # fused-layer's own epilogue, a @triton.jit function: Triton 3.6 lowers it inside this Gluon kernel on
                # the blocked-layout halves (tests/test_kernels_compile.py compiles both callers), one copy of the
                # q/k norm, RoPE and the KV write
                fused_layer._qkv_epilogue(lo, hi, h, rows, row_ok, pid_n, out_ptr, stride_o, qkn_ptr, pos_ptr,
                                          inv_freq_ptr, slot_ptr, k_ptr, v_ptr, cache_slot_stride, eps, NH, NKV,
                                          BLOCK_N, HALF)

    @gluon.jit
    def _residual_half(y, cols, rows, row_ok, N, res_ptr, out_ptr, stride_o, ln_ptr, out2_ptr, LN_NEXT: gl.constexpr):
        """res + y into out; with LN_NEXT also out * ln (the next product's input, rounded from out's value)."""
        m = row_ok[:, None] & (cols < N)[None, :]
        at = rows[:, None] * stride_o + cols[None, :]
        out = (y + gl.load(res_ptr + at, mask=m, other=0.0).to(gl.float32)).to(out_ptr.dtype.element_ty)
        gl.store(out_ptr + at, out, mask=m)
        if LN_NEXT:
            ln = gl.load(ln_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
            gl.store(out2_ptr + at, (out.to(gl.float32) * ln[None, :]).to(out_ptr.dtype.element_ty), mask=m)


def _launch(x, w, counts, cfg: GluonConfig, epi: int, out, pdl: bool, *, norm_of=None, eps=0.0, res=None,
            ln_next=None, out2=None, w_half=0, qkv_args=None) -> None:
    check_operands(x, w)
    m, k = x.shape
    n = w.shape[0]
    blocks = math.ceil(n / cfg.block_n)
    if cfg.split > 1 and counts.numel() < blocks:
        raise ValueError(f"gluon_layer: {counts.numel()} counts for {blocks} column blocks")
    parts = torch.empty(cfg.split, m, blocks * cfg.block_n, device=x.device, dtype=torch.float32)
    qkn, pos, inv_freq, slots, kc, vc, nh, nkv = qkv_args or (out, out, out, out, out, out, 1, 1)
    xr = x if norm_of is None else norm_of
    w_desc, x_desc = gluon_gemm._descriptors(x, w, cfg, pair=epi == SWIGLU)
    launch = {"launch_pdl": True} if pdl else {}
    _fused_kernel[(blocks, cfg.split)](
        w_desc, x_desc, parts, counts, xr, xr.stride(0), out if res is None else res, out, out.stride(0),
        out if ln_next is None else ln_next, out if out2 is None else out2, qkn, pos, inv_freq, slots, kc, vc,
        m, n, k, w_half, kc.stride(0), eps, TILES=tiles_per_split(k, cfg), STAGES=cfg.stages, SPLIT=cfg.split,
        EPI=epi, NORM=norm_of is not None, LN_NEXT=ln_next is not None, NH=nh, NKV=nkv, PDL=pdl, num_warps=4,
        maxnreg=MAX_REGISTERS, **launch)


def residual_product(x, w, residual, counts, ln_next=None, cfg: GluonConfig | None = None, pdl: bool = False):
    """(residual + x @ w.T, and with ln_next [N] that times ln_next: the next normed product's input, else None)."""
    cfg = cfg or gluon_gemm.choose_config(w.shape[0], x.shape[1])
    out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    out2 = torch.empty_like(out) if ln_next is not None else None
    _launch(x, w, counts, cfg, RESIDUAL, out, pdl, res=residual, ln_next=ln_next, out2=out2)
    return out, out2


def swiglu_product(x_ln, x, eps, gate_up, counts, cfg: GluonConfig | None = None, pdl: bool = False):
    """silu(gate) * up of RMSNorm(x) * ln, from x_ln = x * ln (residual_product's second output) and the raw x
    (gate_up [2 I, K]: the gate rows, then the up rows, as layers.MlpWeights stacks them)."""
    two_i, k = gate_up.shape
    cfg = cfg or gluon_gemm.choose_config(two_i, k)
    out = torch.empty(x.shape[0], two_i // 2, device=x.device, dtype=x.dtype)
    _launch(x_ln, gate_up, counts, cfg, SWIGLU, out, pdl, norm_of=x, eps=eps, w_half=two_i // 2)
    return out


def qkv_product(x_ln, x, eps, wqkv, qk_norm, positions, inv_freq, slots, k_cache, v_cache, heads, kv_heads, counts,
                cfg: GluonConfig | None = None, pdl: bool = False):
    """fused_layer.qkv_product's outputs (q returned, k and v written at slots) from x_ln = x * ln and the raw x."""
    n, k = wqkv.shape
    d = qk_norm.shape[1]
    cfg = cfg or gluon_gemm.choose_config(n, k, block_n=d)
    if cfg.block_n != d or n != (heads + 2 * kv_heads) * d:
        raise ValueError(f"gluon_layer: qkv {tuple(wqkv.shape)}, block_n {cfg.block_n}: a head a column block")
    if k_cache.stride(2) != 1 or k_cache.stride(1) != d or v_cache.stride() != k_cache.stride():
        raise ValueError("gluon_layer: the KV caches must be [slots, kv heads, D] with contiguous heads")
    q = torch.empty(x.shape[0], heads * d, device=x.device, dtype=x.dtype)
    _launch(x_ln, wqkv, counts, cfg, QKV, q, pdl, norm_of=x, eps=eps,
            qkv_args=(qk_norm, positions, inv_freq, slots, k_cache, v_cache, heads, kv_heads))
    return q
