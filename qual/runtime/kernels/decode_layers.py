"""Every decoder layer of a one-token target decode step in one persistent Triton kernel.

Why: at batch 1 a compiled step is ~9 small kernels a layer, and each pays launch and ramp-up
time larger than its share of the weight stream (docs/PERFORMANCE.md). Here one program per SM
runs the whole step. Each layer is three phases, separated by grid-wide barriers:

1. RMSNorm, then the q/k/v projection (rows split across programs) into a float32 scratch.
2. Per-head RMSNorm, RoPE, the KV write, attention over the paged store, and the o projection,
   split by (KV head, chunk of output rows); each unit adds its rows into the residual.
3. RMSNorm, gate/up, SiLU(gate)·up and down, split by intermediate rows; each unit adds its
   down-projection partial into the residual.

Units add into the residual with float32 atomics, so the residual stream is float32 and the
summation order (hence the last bits) varies from run to run. It lives in three rotating
buffers: one read, one accumulated into, one zeroed for the next phase that accumulates.

Step inputs (position, write slot, key slots, mask) are read from device memory, so a CUDA
graph replays the kernel with new values. With sync=False the caller launches one phase at a
time instead of meeting at barriers: Triton's interpreter (CPU tests) runs programs one after
another, where a barrier would never open.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

PHASES_PER_LAYER = 3


if triton is not None:
    MAX_SPINS = tl.constexpr(1 << 22)  # a barrier that does not open in this many polls gives up and flags it

    @triton.jit
    def _grid_sync(flags_ptr, target):
        """Wait until `target` arrivals (programs x barriers so far) have been counted."""
        tl.debug_barrier()  # this program's stores are done before it announces arrival
        tl.atomic_add(flags_ptr, 1, sem="release")
        spins = 0
        while (tl.atomic_add(flags_ptr, 0, sem="acquire") < target) & (spins < MAX_SPINS):
            spins += 1
        if spins >= MAX_SPINS:
            tl.atomic_max(flags_ptr + 1, 1)
        tl.debug_barrier()

    @triton.jit
    def _rms_scale(x_ptr, w_ptr, eps, H: tl.constexpr, HB: tl.constexpr):
        """1 / rms of the float32 vector at x_ptr (every program reads it whole: 4 bytes x hidden)."""
        cols = tl.arange(0, HB)
        x = tl.load(x_ptr + cols, mask=cols < H, other=0.0, cache_modifier=".cg")
        return tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)

    @triton.jit
    def _qkv_phase(pid, nprog, x_ptr, ln_ptr, w_ptr, qkv_ptr, zero_ptr, eps,
                   H: tl.constexpr, HB: tl.constexpr, NQKV: tl.constexpr, RQ: tl.constexpr, KB: tl.constexpr):
        rstd = _rms_scale(x_ptr, ln_ptr, eps, H, HB)
        for u in range(pid, tl.cdiv(NQKV, RQ), nprog):
            rows = u * RQ + tl.arange(0, RQ)
            acc = tl.zeros((RQ,), tl.float32)
            for k0 in tl.static_range(0, HB, KB):
                c = k0 + tl.arange(0, KB)
                xn = tl.load(x_ptr + c, mask=c < H, other=0.0, cache_modifier=".cg") * rstd \
                    * tl.load(ln_ptr + c, mask=c < H, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + rows[:, None] * H + c[None, :], mask=(rows[:, None] < NQKV) & (c[None, :] < H), other=0.0)
                acc += tl.sum(w.to(tl.float32) * xn[None, :], axis=1)
            tl.store(qkv_ptr + rows, acc, mask=rows < NQKV)
        if pid == 0:  # the buffer phase 2 accumulates into
            cols = tl.arange(0, HB)
            tl.store(zero_ptr + cols, tl.zeros((HB,), tl.float32), mask=cols < H)

    @triton.jit
    def _norm_rope(a, b, rstd, n1, n2, cos, sin):
        """Per-head RMSNorm (rstd given), then rotate-half RoPE, on a head held as halves a, b."""
        a = a * rstd * n1
        b = b * rstd * n2
        return a * cos - b * sin, b * cos + a * sin

    @triton.jit
    def _attn_phase(pid, nprog, layer, x_ptr, acc_ptr, zero_ptr, qkv_ptr, qn_ptr, kn_ptr, o_ptr, inv_freq_ptr,
                    k_ptr, v_ptr, cache_layer_stride, cache_slot_stride, pos_ptr, wslot_ptr, slots_ptr, mask_ptr, S,
                    eps, scale, H: tl.constexpr, HB: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr,
                    D: tl.constexpr, NC: tl.constexpr, RO: tl.constexpr, BS: tl.constexpr):
        GQ: tl.constexpr = NH // NKV
        HALF: tl.constexpr = D // 2
        g = tl.arange(0, GQ)
        dh = tl.arange(0, HALF)
        pos = tl.load(pos_ptr)
        wslot = tl.load(wslot_ptr)
        angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + dh)
        cos, sin = tl.cos(angle), tl.sin(angle)
        qn1, qn2 = tl.load(qn_ptr + dh).to(tl.float32), tl.load(qn_ptr + HALF + dh).to(tl.float32)
        kn1, kn2 = tl.load(kn_ptr + dh).to(tl.float32), tl.load(kn_ptr + HALF + dh).to(tl.float32)
        cache = layer.to(tl.int64) * cache_layer_stride
        for u in range(pid, NKV * NC, nprog):
            hk = u // NC
            chunk = u % NC
            heads = hk * GQ + g
            q1 = tl.load(qkv_ptr + heads[:, None] * D + dh[None, :], cache_modifier=".cg")
            q2 = tl.load(qkv_ptr + heads[:, None] * D + HALF + dh[None, :], cache_modifier=".cg")
            kv = qkv_ptr + NH * D + hk * D
            k1, k2 = tl.load(kv + dh, cache_modifier=".cg"), tl.load(kv + HALF + dh, cache_modifier=".cg")
            v1 = tl.load(kv + NKV * D + dh, cache_modifier=".cg")
            v2 = tl.load(kv + NKV * D + HALF + dh, cache_modifier=".cg")
            rq = tl.rsqrt((tl.sum(q1 * q1, axis=1) + tl.sum(q2 * q2, axis=1)) / D + eps)[:, None]
            q1, q2 = _norm_rope(q1, q2, rq, qn1[None, :], qn2[None, :], cos[None, :], sin[None, :])
            rk = tl.rsqrt((tl.sum(k1 * k1, axis=0) + tl.sum(k2 * k2, axis=0)) / D + eps)
            k1, k2 = _norm_rope(k1, k2, rk, kn1, kn2, cos, sin)
            here = cache + wslot.to(tl.int64) * cache_slot_stride + hk * D
            if chunk == 0:  # one unit per KV head stores the new token; the others use it from registers
                tl.store(k_ptr + here + dh, k1.to(k_ptr.dtype.element_ty))
                tl.store(k_ptr + here + HALF + dh, k2.to(k_ptr.dtype.element_ty))
                tl.store(v_ptr + here + dh, v1.to(v_ptr.dtype.element_ty))
                tl.store(v_ptr + here + HALF + dh, v2.to(v_ptr.dtype.element_ty))
            # online softmax, seeded with the new token (always visible to itself)
            m = (tl.sum(q1 * k1[None, :], axis=1) + tl.sum(q2 * k2[None, :], axis=1)) * scale
            den = tl.full((GQ,), 1.0, tl.float32)
            acc1 = tl.zeros((GQ, HALF), tl.float32) + v1[None, :]
            acc2 = tl.zeros((GQ, HALF), tl.float32) + v2[None, :]
            for s0 in range(0, S, BS):
                s = s0 + tl.arange(0, BS)
                slot = tl.load(slots_ptr + s, mask=s < S, other=0)
                seen = (tl.load(mask_ptr + s, mask=s < S, other=0) != 0) & (slot != wslot)  # the new slot: above
                at = cache + slot.to(tl.int64)[:, None] * cache_slot_stride + hk * D + dh[None, :]
                kk1 = tl.load(k_ptr + at, mask=seen[:, None], other=0.0).to(tl.float32)
                kk2 = tl.load(k_ptr + at + HALF, mask=seen[:, None], other=0.0).to(tl.float32)
                sc = (tl.sum(q1[:, None, :] * kk1[None, :, :], axis=2) + tl.sum(q2[:, None, :] * kk2[None, :, :], axis=2)) * scale
                sc = tl.where(seen[None, :], sc, float("-inf"))
                m_new = tl.maximum(m, tl.max(sc, axis=1))
                p = tl.exp(sc - m_new[:, None])
                alpha = tl.exp(m - m_new)
                vv1 = tl.load(v_ptr + at, mask=seen[:, None], other=0.0).to(tl.float32)
                vv2 = tl.load(v_ptr + at + HALF, mask=seen[:, None], other=0.0).to(tl.float32)
                den = den * alpha + tl.sum(p, axis=1)
                acc1 = acc1 * alpha[:, None] + tl.sum(p[:, :, None] * vv1[None, :, :], axis=1)
                acc2 = acc2 * alpha[:, None] + tl.sum(p[:, :, None] * vv2[None, :, :], axis=1)
                m = m_new
            o1 = acc1 / den[:, None]
            o2 = acc2 / den[:, None]
            # this unit's rows of the o projection, over its KV head's query heads only
            rows = chunk * RO + tl.arange(0, RO)
            w = o_ptr + rows[:, None, None] * (NH * D) + heads[None, :, None] * D + dh[None, None, :]
            wm = rows[:, None, None] < H
            y = tl.sum(tl.sum(tl.load(w, mask=wm, other=0.0).to(tl.float32) * o1[None, :, :], axis=2), axis=1)
            y += tl.sum(tl.sum(tl.load(w + HALF, mask=wm, other=0.0).to(tl.float32) * o2[None, :, :], axis=2), axis=1)
            tl.atomic_add(acc_ptr + rows, y, mask=rows < H, sem="relaxed")
            if u == 0:  # the residual itself, once
                cols = tl.arange(0, HB)
                x = tl.load(x_ptr + cols, mask=cols < H, other=0.0, cache_modifier=".cg")
                tl.atomic_add(acc_ptr + cols, x, mask=cols < H, sem="relaxed")
        if pid == 0:  # the buffer phase 3 accumulates into
            cols = tl.arange(0, HB)
            tl.store(zero_ptr + cols, tl.zeros((HB,), tl.float32), mask=cols < H)

    @triton.jit
    def _mlp_phase(pid, nprog, x_ptr, ln_ptr, gu_ptr, dt_ptr, acc_ptr, eps,
                   H: tl.constexpr, HB: tl.constexpr, I: tl.constexpr, RI: tl.constexpr, RIB: tl.constexpr,
                   KB: tl.constexpr):
        rstd = _rms_scale(x_ptr, ln_ptr, eps, H, HB)
        for u in range(pid, tl.cdiv(I, RI), nprog):
            j = tl.arange(0, RIB)
            rows = u * RI + j
            ok = (j < RI) & (rows < I)
            gate = tl.zeros((RIB,), tl.float32)
            up = tl.zeros((RIB,), tl.float32)
            for k0 in tl.static_range(0, HB, KB):
                c = k0 + tl.arange(0, KB)
                xn = tl.load(x_ptr + c, mask=c < H, other=0.0, cache_modifier=".cg") * rstd \
                    * tl.load(ln_ptr + c, mask=c < H, other=0.0).to(tl.float32)
                wm = ok[:, None] & (c[None, :] < H)
                wg = tl.load(gu_ptr + rows[:, None] * H + c[None, :], mask=wm, other=0.0)
                wu = tl.load(gu_ptr + (I + rows)[:, None] * H + c[None, :], mask=wm, other=0.0)
                gate += tl.sum(wg.to(tl.float32) * xn[None, :], axis=1)
                up += tl.sum(wu.to(tl.float32) * xn[None, :], axis=1)
            act = gate / (1.0 + tl.exp(-gate)) * up  # 0 on rows past the end (their weights load as 0)
            for k0 in tl.static_range(0, HB, KB):
                c = k0 + tl.arange(0, KB)
                wd = tl.load(dt_ptr + rows[:, None] * H + c[None, :], mask=ok[:, None] & (c[None, :] < H), other=0.0)
                y = tl.sum(wd.to(tl.float32) * act[:, None], axis=0)
                if u == 0:  # the residual itself, once
                    y += tl.load(x_ptr + c, mask=c < H, other=0.0, cache_modifier=".cg")
                tl.atomic_add(acc_ptr + c, y, mask=c < H, sem="relaxed")

    @triton.jit
    def _decode_layers_kernel(
            resid_ptr, qkv_ptr, flags_ptr, pos_ptr, wslot_ptr, slots_ptr, mask_ptr, S,
            ln1_ptr, ln2_ptr, wqkv_ptr, qn_ptr, kn_ptr, wo_ptr, wgu_ptr, wdt_ptr, inv_freq_ptr,
            k_ptr, v_ptr, cache_layer_stride, cache_slot_stride, first_phase, last_phase, eps, scale,
            H: tl.constexpr, HB: tl.constexpr, I: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
            RQ: tl.constexpr, NC: tl.constexpr, RO: tl.constexpr, RI: tl.constexpr, RIB: tl.constexpr,
            KB: tl.constexpr, BS: tl.constexpr, SYNC: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        NQKV: tl.constexpr = (NH + 2 * NKV) * D
        for ph in range(first_phase, last_phase):
            layer = ph // 3
            kind = ph % 3
            r_in = resid_ptr + ((2 * layer) % 3) * H  # the layer's input residual
            r_mid = resid_ptr + ((2 * layer + 1) % 3) * H  # after attention
            r_out = resid_ptr + ((2 * layer + 2) % 3) * H  # after the MLP
            lw = layer.to(tl.int64)
            if kind == 0:
                _qkv_phase(pid, nprog, r_in, ln1_ptr + lw * H, wqkv_ptr + lw * NQKV * H, qkv_ptr, r_mid, eps,
                           H, HB, NQKV, RQ, KB)
            elif kind == 1:
                _attn_phase(pid, nprog, layer, r_in, r_mid, r_out, qkv_ptr, qn_ptr + lw * D, kn_ptr + lw * D,
                            wo_ptr + lw * H * NH * D, inv_freq_ptr, k_ptr, v_ptr, cache_layer_stride, cache_slot_stride,
                            pos_ptr, wslot_ptr, slots_ptr, mask_ptr, S, eps, scale, H, HB, NH, NKV, D, NC, RO, BS)
            else:
                _mlp_phase(pid, nprog, r_mid, ln2_ptr + lw * H, wgu_ptr + lw * 2 * I * H, wdt_ptr + lw * I * H, r_out, eps,
                           H, HB, I, RI, RIB, KB)
            if SYNC:
                _grid_sync(flags_ptr, (ph - first_phase + 1) * nprog)


@dataclass
class StackedWeights:
    """Per-layer weights stacked along a leading layer dimension (the kernel indexes them by layer).

    down_t is down_proj transposed ([layers, intermediate, hidden]): a unit's slice of it is contiguous.
    """

    ln1: torch.Tensor  # [L, H]
    ln2: torch.Tensor  # [L, H]
    qkv: torch.Tensor  # [L, (NH + 2 NKV) D, H]
    q_norm: torch.Tensor  # [L, D]
    k_norm: torch.Tensor  # [L, D]
    o: torch.Tensor  # [L, H, NH D]
    gate_up: torch.Tensor  # [L, 2 I, H]
    down_t: torch.Tensor  # [L, I, H]
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Tiling:
    """How the work of each phase is cut into units (one unit = one program's share)."""

    rows_qkv: int  # q/k/v rows per unit (power of 2)
    o_chunks: int  # units per KV head in phase 2
    rows_o: int  # o-projection rows per unit (power of 2)
    rows_mlp: int  # intermediate rows per unit
    rows_mlp_block: int  # rows_mlp rounded up to a power of 2
    k_block: int  # hidden columns per load
    key_block: int  # keys per attention step
    num_warps: int

    @classmethod
    def for_shape(cls, programs: int, hidden: int, intermediate: int, nqkv: int, num_kv_heads: int,
                  k_block: int = 256, num_warps: int = 8) -> "Tiling":
        p2 = triton.next_power_of_2
        rows_qkv = p2(-(-nqkv // programs))
        o_chunks = max(1, programs // num_kv_heads)
        rows_o = p2(-(-hidden // o_chunks))
        rows_mlp = -(-intermediate // programs)
        return cls(rows_qkv, o_chunks, rows_o, rows_mlp, p2(rows_mlp), min(k_block, p2(hidden)), 32, num_warps)


def decode_layers(x0: torch.Tensor, position: torch.Tensor, write_slot: torch.Tensor, slots: torch.Tensor,
                  mask: torch.Tensor, w: StackedWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  inv_freq: torch.Tensor, eps: float, scale: float, programs: int, tiling: Tiling | None = None,
                  sync: bool = True, info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every layer for one token. Returns (residual after the last layer, float32 [hidden]; flags int32 [2]).

    x0 [hidden]: the token's embedding. position, write_slot [1]; slots [S] and mask [S] (bool): the
    request's key slots and which are visible. k/v_cache [L, slots, NKV, D] (written at write_slot).
    flags[1] != 0 means a barrier gave up waiting: the result is wrong (reported, never a hang).
    info, if given, receives the compiled kernel's registers and spills per thread (benchmarks).
    """
    L, H = w.ln1.shape
    NH, NKV, D = w.num_heads, w.num_kv_heads, w.head_dim
    I = w.down_t.shape[1]
    nqkv = (NH + 2 * NKV) * D
    if k_cache.stride(3) != 1 or k_cache.stride(2) != D or v_cache.stride() != k_cache.stride():
        raise ValueError("decode_layers: the KV caches must be [L, slots, NKV, D] with contiguous heads")
    if NH % NKV or (NH // NKV) & (NH // NKV - 1) or D & (D - 1) or D < 2:
        raise ValueError(f"decode_layers: heads {NH}/{NKV}, head_dim {D} (need a power-of-2 group size and head_dim)")
    tiling = tiling or Tiling.for_shape(programs, H, I, nqkv, NKV)
    t = tiling
    resid = torch.zeros(3, H, device=x0.device, dtype=torch.float32)
    resid[0].copy_(x0)
    qkv = torch.empty(nqkv, device=x0.device, dtype=torch.float32)
    flags = torch.zeros(2, device=x0.device, dtype=torch.int32)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.int8)
    args = (resid, qkv, flags, position, write_slot, slots, mask, slots.shape[0],
            w.ln1, w.ln2, w.qkv, w.q_norm, w.k_norm, w.o, w.gate_up, w.down_t, inv_freq,
            k_cache, v_cache, k_cache.stride(0), k_cache.stride(1))
    meta = dict(H=H, HB=triton.next_power_of_2(H), I=I, NH=NH, NKV=NKV, D=D, RQ=t.rows_qkv, NC=t.o_chunks, RO=t.rows_o,
                RI=t.rows_mlp, RIB=t.rows_mlp_block, KB=t.k_block, BS=t.key_block, num_warps=t.num_warps)
    phases = [(0, L * PHASES_PER_LAYER)] if sync else [(p, p + 1) for p in range(L * PHASES_PER_LAYER)]
    for first, last in phases:
        launch = _decode_layers_kernel[(programs,)](*args, first, last, eps, scale, SYNC=sync, **meta)
    if info is not None:
        info.update(n_regs=getattr(launch, "n_regs", None), n_spills=getattr(launch, "n_spills", None))
    return resid[(2 * L) % 3], flags
