"""Every decoder layer of a one-token target decode step in one persistent Triton kernel.

Why: at batch 1 a compiled step is several small kernels a layer, and each pays launch and ramp-up
time larger than its share of the weight stream (docs/PERFORMANCE.md, "What limits it"). Here one
program per SM runs the whole step. Each layer is four phases, separated by grid-wide barriers:

1. RMSNorm, then the q/k/v projection (rows split across programs) into a float32 scratch.
2. Per-head RMSNorm, RoPE, the KV write, and attention over the paged store, split by
   (KV head, slice of the keys): each unit stores an unnormalised partial with its max and sum.
3. Per (KV head, chunk of output rows): merge the KV head's partials by log-sum-exp, then that
   chunk of the o projection, added into the residual.
4. RMSNorm, gate/up, SiLU(gate)·up and down, split by intermediate rows; each unit adds its
   down-projection partial into the residual.

Whatever a phase reads that the phase before does not write (its weights, the cached keys) is
requested between arriving at the barrier and waiting there, so it streams in meanwhile.

Units add into the residual with float32 atomics, so the residual stream is float32 and the
summation order (hence the last bits) varies from run to run. It lives in three rotating
buffers: one read, one accumulated into, one zeroed for the next phase that accumulates.

Step inputs (position, write slot, key slots, mask) are read from device memory, so a CUDA
graph replays the kernel with new values. With sync=False the caller launches one phase at a
time instead of meeting at barriers: Triton's interpreter (CPU tests) runs programs one after
another, where a barrier would never open.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from qual.validation import ascii_digits

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

PHASES_PER_LAYER = 4  # q/k/v; attention over a slice of the keys; merge + o projection; MLP
# A program holds its weight tiles in registers (64K 32-bit registers an SM): beyond these the kernel spills
# to local memory on every tile, so larger shapes are refused rather than run slowly.
MAX_QKV_TILE_BYTES = 128 << 10
MAX_MLP_TILE_BYTES = 192 << 10  # gate + up + down rows of one step


if triton is not None:
    from qual.runtime.backends.decode_attention import _attn_merge_phase, _attn_partial_phase, _kv_block, _o_tile
    from qual.runtime.backends.grid_barrier import _arrive, _now, _wait, _zero_next

    @triton.jit
    def _rms_normed(x_ptr, ln_ptr, eps, H: tl.constexpr, HB: tl.constexpr):
        """(x, RMSNorm(x) * ln) for the float32 residual at x_ptr, [HB] each (every program reads it whole)."""
        cols = tl.arange(0, HB)
        x = tl.load(x_ptr + cols, mask=cols < H, other=0.0, cache_modifier=".cg")  # .cg: written this step, skip L1
        return x, x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps) * tl.load(ln_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)

    @triton.jit
    def _qkv_tile(w_ptr, pid, live, H: tl.constexpr, HB: tl.constexpr, NQKV: tl.constexpr, RQ: tl.constexpr):
        """This program's q/k/v weight rows [RQ, HB] (nothing is read where live is false)."""
        rows = pid * RQ + tl.arange(0, RQ)
        cols = tl.arange(0, HB)
        end = tl.where(live, NQKV, 0)
        return tl.load(w_ptr + rows[:, None] * H + cols[None, :], mask=(rows[:, None] < end) & (cols[None, :] < H), other=0.0)

    @triton.jit
    def _qkv_phase(pid, w, x_ptr, ln_ptr, qkv_ptr, zero_ptr, eps,
                   H: tl.constexpr, HB: tl.constexpr, NQKV: tl.constexpr, RQ: tl.constexpr):
        if pid < tl.cdiv(NQKV, RQ):
            _, xn = _rms_normed(x_ptr, ln_ptr, eps, H, HB)
            rows = pid * RQ + tl.arange(0, RQ)
            tl.store(qkv_ptr + rows, tl.sum(w.to(tl.float32) * xn[None, :], axis=1), mask=rows < NQKV)
        _zero_next(pid, zero_ptr, H, HB)  # the buffer the o projection accumulates into

    @triton.jit
    def _mlp_rows(gu_ptr, dt_ptr, rows, ok, cols, H: tl.constexpr, I: tl.constexpr):
        """gate, up and down^T rows [RS, HB] of one sub-block."""
        m = ok[:, None] & (cols[None, :] < H)
        return (tl.load(gu_ptr + rows[:, None] * H + cols[None, :], mask=m, other=0.0),
                tl.load(gu_ptr + (I + rows)[:, None] * H + cols[None, :], mask=m, other=0.0),
                tl.load(dt_ptr + rows[:, None] * H + cols[None, :], mask=m, other=0.0))

    @triton.jit
    def _mlp_phase(pid, wg, wu, wd, x_ptr, ln_ptr, gu_ptr, dt_ptr, acc_ptr, eps,
                   H: tl.constexpr, HB: tl.constexpr, I: tl.constexpr, RI: tl.constexpr, RS: tl.constexpr):
        """RI intermediate rows per unit, RS at a time (the first RS given); the next RS rows' weights load
        while these compute."""
        NSUB: tl.constexpr = (RI + RS - 1) // RS
        if pid < tl.cdiv(I, RI):
            j = tl.arange(0, RS)
            cols = tl.arange(0, HB)
            x, xn = _rms_normed(x_ptr, ln_ptr, eps, H, HB)
            y = tl.where(pid == 0, x, 0.0)  # the residual itself, once
            for i in tl.static_range(NSUB):
                if i + 1 < NSUB:
                    nxt = pid * RI + (i + 1) * RS + j
                    wg2, wu2, wd2 = _mlp_rows(gu_ptr, dt_ptr, nxt, ((i + 1) * RS + j < RI) & (nxt < I), cols, H, I)
                gate = tl.sum(wg.to(tl.float32) * xn[None, :], axis=1)
                up = tl.sum(wu.to(tl.float32) * xn[None, :], axis=1)
                act = gate / (1.0 + tl.exp(-gate)) * up  # 0 on rows past the end (their weights load as 0)
                y += tl.sum(wd.to(tl.float32) * act[:, None], axis=0)
                if i + 1 < NSUB:
                    wg, wu, wd = wg2, wu2, wd2
            tl.atomic_add(acc_ptr + cols, y, mask=cols < H, sem="relaxed")

    @triton.jit
    def _decode_layers_kernel(
            resid_ptr, qkv_ptr, part_ptr, flags_ptr, timeout_ptr, times_ptr, pos_ptr, wslot_ptr, slots_ptr, mask_ptr, S,
            ln1_ptr, ln2_ptr, wqkv_ptr, qn_ptr, kn_ptr, wo_ptr, wgu_ptr, wdt_ptr, inv_freq_ptr,
            k_ptr, v_ptr, cache_layer_stride, cache_slot_stride, first_phase, last_phase, eps, scale,
            H: tl.constexpr, HB: tl.constexpr, I: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
            RQ: tl.constexpr, NC: tl.constexpr, NCB: tl.constexpr, RO: tl.constexpr, RI: tl.constexpr, RS: tl.constexpr,
            BS: tl.constexpr, MQ: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
            SYNC: tl.constexpr, POLL_ACQUIRE: tl.constexpr, PF_QKV: tl.constexpr, PF_MLP: tl.constexpr,
            WORK: tl.constexpr, TIMING: tl.constexpr):
        pid = tl.program_id(0)
        NQKV: tl.constexpr = (NH + 2 * NKV) * D
        if TIMING:
            if pid == 0:
                tl.store(times_ptr, _now())
        first_layer = first_phase // 4
        last_layer = (last_phase + 3) // 4
        mlp_j = tl.arange(0, RS)
        wslot = tl.load(wslot_ptr)
        # Key s is at position s (one rank): those past this token's position are never visible. So the keys
        # are split over a KV head's chunks by how many can be, not by the static key width (max_model_len).
        S = tl.minimum(S, tl.load(pos_ptr).to(tl.int32) + 1)
        KPU = tl.cdiv(S, NC)
        lo = (pid % NC) * KPU
        hi = tl.where(pid < NKV * NC, tl.minimum(lo + KPU, S), 0)  # this program's keys in the attention phase
        nprog = tl.num_programs(0)
        arrivals = times_ptr + (last_phase - first_phase + 1) + pid  # TIMING: [barrier, program] arrival stamps
        # Each phase's inputs that do not depend on the phase before (weights, cached keys) are requested
        # between arriving at the barrier ahead of it and waiting there: they stream in meanwhile.
        if PF_QKV:
            wq = _qkv_tile(wqkv_ptr + tl.cast(first_layer, tl.int64) * NQKV * H, pid, first_layer < last_layer, H, HB,
                           NQKV, RQ)
        for layer in range(first_layer, last_layer):
            ph = 4 * layer
            lw = tl.cast(layer, tl.int64)
            if not PF_QKV:
                wq = _qkv_tile(wqkv_ptr + lw * NQKV * H, pid, layer < last_layer, H, HB, NQKV, RQ)
            r_in = resid_ptr + ((2 * layer) % 3) * H  # the layer's input residual
            r_mid = resid_ptr + ((2 * layer + 1) % 3) * H  # after attention
            r_out = resid_ptr + ((2 * layer + 2) % 3) * H  # after the MLP
            if WORK & 1:
                if (ph >= first_phase) & (ph < last_phase):
                    _qkv_phase(pid, wq, r_in, ln1_ptr + lw * H, qkv_ptr, r_mid, eps, H, HB, NQKV, RQ)
            if SYNC:
                _arrive(flags_ptr, arrivals + (ph - first_phase) * nprog, TIMING)
            cache = lw * cache_layer_stride
            kk1, kk2, vv1, vv2, seen = _kv_block(k_ptr, v_ptr, cache, cache_slot_stride, slots_ptr, mask_ptr, wslot, lo,
                                                 hi, pid // NC, BS, D)
            if SYNC:
                _wait(flags_ptr, timeout_ptr, ph + 1 - first_phase, times_ptr, POLL_ACQUIRE, TIMING)
            if WORK & 2:
                if (ph + 1 >= first_phase) & (ph + 1 < last_phase):
                    _attn_partial_phase(pid, layer, kk1, kk2, vv1, vv2, seen, qkv_ptr, qn_ptr + lw * D, kn_ptr + lw * D,
                                        inv_freq_ptr, k_ptr, v_ptr, cache_layer_stride, cache_slot_stride, pos_ptr,
                                        wslot_ptr, slots_ptr, mask_ptr, lo, hi, part_ptr, eps, scale, NH, NKV, D, NC, BS,
                                        MQ, USE_DOT, PREC)
            if SYNC:
                _arrive(flags_ptr, arrivals + (ph + 1 - first_phase) * nprog, TIMING)
            wo1, wo2 = _o_tile(wo_ptr + lw * H * NH * D, pid, layer < last_layer, H, NH, NKV, D, NC, RO)
            if SYNC:
                _wait(flags_ptr, timeout_ptr, ph + 2 - first_phase, times_ptr, POLL_ACQUIRE, TIMING)
            if WORK & 2:
                if (ph + 2 >= first_phase) & (ph + 2 < last_phase):
                    _attn_merge_phase(pid, wo1, wo2, r_in, r_mid, r_out, part_ptr, H, HB, NH, NKV, D, NC, NCB, RO)
            if SYNC:
                _arrive(flags_ptr, arrivals + (ph + 2 - first_phase) * nprog, TIMING)
            gu = wgu_ptr + lw * 2 * I * H
            dt = wdt_ptr + lw * I * H
            rows = pid * RI + mlp_j
            if PF_MLP:
                wg, wu, wd = _mlp_rows(gu, dt, rows, (mlp_j < RI) & (rows < I), tl.arange(0, HB), H, I)
            if SYNC:
                _wait(flags_ptr, timeout_ptr, ph + 3 - first_phase, times_ptr, POLL_ACQUIRE, TIMING)
            if WORK & 4:
                if (ph + 3 >= first_phase) & (ph + 3 < last_phase):
                    if not PF_MLP:
                        wg, wu, wd = _mlp_rows(gu, dt, rows, (mlp_j < RI) & (rows < I), tl.arange(0, HB), H, I)
                    _mlp_phase(pid, wg, wu, wd, r_mid, ln2_ptr + lw * H, gu, dt, r_out, eps, H, HB, I, RI, RS)
            if SYNC:
                _arrive(flags_ptr, arrivals + (ph + 3 - first_phase) * nprog, TIMING)
            if PF_QKV:
                wq = _qkv_tile(wqkv_ptr + (lw + 1) * NQKV * H, pid, layer + 1 < last_layer, H, HB, NQKV, RQ)
            if SYNC:
                _wait(flags_ptr, timeout_ptr, ph + 4 - first_phase, times_ptr, POLL_ACQUIRE, TIMING)


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
    o_chunks: int  # units per KV head in the attention phases (key slices, then o-projection row chunks)
    rows_o: int  # o-projection rows per unit (power of 2)
    rows_mlp: int  # intermediate rows per unit
    rows_mlp_step: int  # of which this many (a power of 2) at a time
    key_block: int  # at most this many keys per attention step
    num_warps: int
    poll_acquire: bool = True  # barrier polls with acquire loads (else volatile loads + an acquire atomic)
    attn_dot: bool = True  # attention scores and p @ v on tensor cores (tl.dot; only where head_dim / 2 >= 16)
    prefetch_qkv: bool = True  # request the q/k/v weights before the barrier ahead of their phase (else after)
    prefetch_mlp: bool = True  # the same for the MLP's first rows

    @classmethod
    def for_shape(cls, programs: int, hidden: int, intermediate: int, nqkv: int, num_kv_heads: int, head_dim: int,
                  num_warps: int = 8, mlp_step: int = 32) -> "Tiling":
        """At most one unit per program in every phase (a program's share is then loaded in one go)."""
        p2 = triton.next_power_of_2
        rows_qkv = p2(-(-nqkv // programs))
        o_chunks = programs // num_kv_heads
        rows_o = p2(-(-hidden // o_chunks))  # o_chunks x rows_o >= hidden: every row has a unit
        rows_mlp = -(-intermediate // programs)
        fit = 1 << max(0, (MAX_MLP_TILE_BYTES // (6 * p2(hidden))).bit_length() - 1)  # MLP rows a step that fit
        key_block = 64  # keys an attention step: a unit loops over blocks when its share of the keys is longer
        return cls(rows_qkv, o_chunks, rows_o, rows_mlp, min(mlp_step, p2(rows_mlp), fit), key_block, num_warps)

    def with_spec(self, spec: str) -> "Tiling":
        """This tiling changed by a benchmark's spec: num_warps x MLP rows a step x barrier polls (a: acquire
        loads, v: volatile loads + an acquire atomic) x attention (d: tl.dot, b: broadcast products) x weights
        requested before the barrier (q: q/k/v, m: the MLP's; both, one or neither), e.g. 8x32xaxdxqm; then,
        optionally, b<keys> for the key block, e.g. 8x32xaxdxqmxb32."""
        warps, step, poll, attn, pf, *block = spec.split("x")
        if len(block) > 1 or block and not (block[0][:1] == "b" and ascii_digits(block[0][1:])):
            raise ValueError(f"tiling spec {spec!r}: after the five fields only b<keys a block>")
        return replace(self, num_warps=int(warps), rows_mlp_step=int(step), poll_acquire=poll == "a",
                       attn_dot=attn == "d", prefetch_qkv="q" in pf, prefetch_mlp="m" in pf,
                       key_block=int(block[0][1:]) if block else self.key_block)

    def too_big(self, hidden: int) -> str | None:
        """Why this tiling does not fit a program's registers for `hidden`, or None."""
        width = 2 * triton.next_power_of_2(hidden)  # bytes of one bf16 row, padded
        if self.rows_qkv * width > MAX_QKV_TILE_BYTES:
            return (f"{self.rows_qkv} q/k/v rows x hidden {hidden} per program exceed {MAX_QKV_TILE_BYTES >> 10} KiB of "
                    "registers (a model this size needs more programs than SMs; use the per-layer path)")
        if 3 * self.rows_mlp_step * width > MAX_MLP_TILE_BYTES:
            return f"hidden {hidden} is too wide for one MLP row step in {MAX_MLP_TILE_BYTES >> 10} KiB of registers"
        return None


def decode_layers(x0: torch.Tensor, position: torch.Tensor, write_slot: torch.Tensor, slots: torch.Tensor,
                  mask: torch.Tensor, w: StackedWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  inv_freq: torch.Tensor, eps: float, scale: float, programs: int, tiling: Tiling | None = None,
                  sync: bool = True, info: dict | None = None, timeouts: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every layer for one token. Returns (residual after the last layer, float32 [hidden]; int32 [2]:
    barrier arrivals in this launch, timeouts so far).

    x0 [hidden]: the token's embedding. position, write_slot [1]; slots [S] and mask [S] (bool): the
    request's key slots and which are visible, key s at position s (one rank, no DCP): only the first
    position + 1 are read, however wide S (a CUDA graph's static key width, up to max_model_len).
    k/v_cache [L, slots, NKV, D] (written at write_slot).
    A barrier that gives up waiting sets timeouts[0] (the caller's, kept across steps; else a fresh one): the
    result is then wrong. That is reported, never a hang.
    info, if given, receives the compiled kernel's registers and spills per thread (benchmarks). If it holds
    "work" (a bit mask of the phases to run: 1 q/k/v, 2 attention (both phases), 4 MLP), the kernel also records
    a timestamp after every phase into info["times"] (int64 ns; GPU only), each program's arrival at every barrier
    into info["arrivals"] ([barriers, programs]), and skips the phases left out.
    """
    L, H = w.ln1.shape
    NH, NKV, D = w.num_heads, w.num_kv_heads, w.head_dim
    I = w.down_t.shape[1]
    nqkv = (NH + 2 * NKV) * D
    if k_cache.stride(3) != 1 or k_cache.stride(2) != D or v_cache.stride() != k_cache.stride():
        raise ValueError("decode_layers: the KV caches must be [L, slots, NKV, D] with contiguous heads")
    if NH % NKV or (NH // NKV) & (NH // NKV - 1) or D & (D - 1) or D < 2:
        raise ValueError(f"decode_layers: heads {NH}/{NKV}, head_dim {D} (need a power-of-2 group size and head_dim)")
    if programs < NKV:
        raise ValueError(f"decode_layers: {programs} programs < {NKV} KV heads (phase 2 needs one per KV head)")
    t = tiling or Tiling.for_shape(programs, H, I, nqkv, NKV, D)
    timing = info is not None and "work" in info  # benchmarks: per-phase timestamps, and phases left out
    resid = torch.zeros(3, H, device=x0.device, dtype=torch.float32)
    resid[0].copy_(x0)
    qkv = torch.empty(nqkv, device=x0.device, dtype=torch.float32)
    part = torch.empty(NKV * t.o_chunks * (NH // NKV) * (D + 2), device=x0.device, dtype=torch.float32)
    flags = torch.zeros(2, device=x0.device, dtype=torch.int32)  # arrivals, a target for acquire atomics
    timeouts = torch.zeros(1, device=x0.device, dtype=torch.int32) if timeouts is None else timeouts
    barriers = L * PHASES_PER_LAYER
    times = torch.zeros(barriers + 1 + (barriers * programs if timing else 0), device=x0.device, dtype=torch.int64)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.int8)
    S = slots.shape[0]
    keys_per_unit = -(-S // t.o_chunks)  # at most: the kernel splits the keys up to the token's position
    use_dot = t.attn_dot and D // 2 >= 16
    key_block = max(min(t.key_block, triton.next_power_of_2(keys_per_unit)), 16 if use_dot else 2)  # tl.dot: >= 16
    args = (resid, qkv, part, flags, timeouts, times, position, write_slot, slots, mask, S,
            w.ln1, w.ln2, w.qkv, w.q_norm, w.k_norm, w.o, w.gate_up, w.down_t, inv_freq,
            k_cache, v_cache, k_cache.stride(0), k_cache.stride(1))
    meta = dict(H=H, HB=triton.next_power_of_2(H), I=I, NH=NH, NKV=NKV, D=D, RQ=t.rows_qkv, NC=t.o_chunks, RO=t.rows_o,
                NCB=triton.next_power_of_2(t.o_chunks), RI=t.rows_mlp, RS=t.rows_mlp_step, BS=key_block,
                POLL_ACQUIRE=t.poll_acquire, PF_QKV=t.prefetch_qkv, PF_MLP=t.prefetch_mlp,
                MQ=max(16, NH // NKV) if use_dot else NH // NKV, USE_DOT=use_dot,
                PREC="ieee" if k_cache.dtype == torch.float32 else "tf32", num_warps=t.num_warps,
                WORK=info["work"] if timing else 7, TIMING=timing)
    phases = [(0, L * PHASES_PER_LAYER)] if sync else [(p, p + 1) for p in range(L * PHASES_PER_LAYER)]
    for first, last in phases:
        launch = _decode_layers_kernel[(programs,)](*args, first, last, eps, scale, SYNC=sync, **meta)
    if info is not None:
        info.update(n_regs=getattr(launch, "n_regs", None), n_spills=getattr(launch, "n_spills", None),
                    times=times[:barriers + 1], arrivals=times[barriers + 1:].view(-1, programs))
    return resid[(2 * L) % 3], torch.cat([flags[:1], timeouts])
