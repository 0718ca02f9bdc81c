"""The attention phases of the fused decode kernel (qual/runtime/backends/decode_layers.py): per-head norm and RoPE,
attention over a slice of the paged keys keeping an unnormalised partial with its max and sum, then the merge of a
KV head's partials by log-sum-exp and that chunk of the o projection."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None


if triton is not None:
    from qual.runtime.backends.grid_barrier import _zero_next

    @triton.jit
    def _norm_rope(a, b, rstd, n1, n2, cos, sin):
        """Per-head RMSNorm (rstd given), then rotate-half RoPE, on a head held as halves a, b."""
        a = a * rstd * n1
        b = b * rstd * n2
        return a * cos - b * sin, b * cos + a * sin

    @triton.jit
    def _scores(q1, q2, k1, k2, USE_DOT: tl.constexpr, PREC: tl.constexpr):
        """[MQ, BS] q.k over both halves (tensor cores when the head is wide enough for tl.dot)."""
        if USE_DOT:
            return tl.dot(q1.to(k1.dtype), tl.trans(k1), input_precision=PREC) \
                + tl.dot(q2.to(k2.dtype), tl.trans(k2), input_precision=PREC)
        return tl.sum(q1[:, None, :] * k1.to(tl.float32)[None, :, :], axis=2) \
            + tl.sum(q2[:, None, :] * k2.to(tl.float32)[None, :, :], axis=2)

    @triton.jit
    def _weighted(p, v, USE_DOT: tl.constexpr, PREC: tl.constexpr):
        """[MQ, HALF] p @ v."""
        if USE_DOT:
            return tl.dot(p.to(v.dtype), v, input_precision=PREC)
        return tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)

    @triton.jit
    def _o_tile(o_ptr, pid, live, H: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                NC: tl.constexpr, RO: tl.constexpr):
        """This program's o-projection rows over its KV head's query heads, as two halves [RO, GQ, D/2]."""
        GQ: tl.constexpr = NH // NKV
        HALF: tl.constexpr = D // 2
        rows = (pid % NC) * RO + tl.arange(0, RO)
        heads = (pid // NC) * GQ + tl.arange(0, GQ)
        wo = o_ptr + rows[:, None, None] * (NH * D) + heads[None, :, None] * D + tl.arange(0, HALF)[None, None, :]
        m = (rows[:, None, None] < tl.where(live & (pid < NKV * NC), H, 0))
        return tl.load(wo, mask=m, other=0.0), tl.load(wo + HALF, mask=m, other=0.0)

    @triton.jit
    def _kv_block(k_ptr, v_ptr, cache, cache_slot_stride, slots_ptr, mask_ptr, wslot, s0, hi, hk,
                  BS: tl.constexpr, D: tl.constexpr):
        """Keys s0 .. s0+BS (those < hi) of one KV head: K and V halves [BS, D/2] and which are visible."""
        HALF: tl.constexpr = D // 2
        s = s0 + tl.arange(0, BS)
        dh = tl.arange(0, HALF)
        slot = tl.load(slots_ptr + s, mask=s < hi, other=0)
        seen = (tl.load(mask_ptr + s, mask=s < hi, other=0) != 0) & (slot != wslot) & (s < hi)  # new slot: registers
        at = cache + slot.to(tl.int64)[:, None] * cache_slot_stride + hk * D + dh[None, :]
        inside = (s < hi)[:, None]
        return (tl.load(k_ptr + at, mask=inside, other=0.0), tl.load(k_ptr + at + HALF, mask=inside, other=0.0),
                tl.load(v_ptr + at, mask=inside, other=0.0), tl.load(v_ptr + at + HALF, mask=inside, other=0.0), seen)

    @triton.jit
    def _attend(q1, q2, kk1, kk2, vv1, vv2, seen, m, den, acc1, acc2, scale, USE_DOT: tl.constexpr, PREC: tl.constexpr):
        """One online-softmax step over a block of keys (rows with nothing visible yet stay at m = -inf)."""
        sc = tl.where(seen[None, :], _scores(q1, q2, kk1, kk2, USE_DOT, PREC) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(sc - base[:, None])
        alpha = tl.exp(m - base)
        return (m_new, den * alpha + tl.sum(p, axis=1), acc1 * alpha[:, None] + _weighted(p, vv1, USE_DOT, PREC),
                acc2 * alpha[:, None] + _weighted(p, vv2, USE_DOT, PREC))

    @triton.jit
    def _attention(pid, layer, kk1, kk2, vv1, vv2, seen, qkv_ptr, qn_ptr, kn_ptr, inv_freq_ptr, k_ptr, v_ptr,
                   cache_layer_stride, cache_slot_stride, pos_ptr, wslot_ptr, slots_ptr, mask_ptr, lo, hi, eps, scale,
                   NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, NC: tl.constexpr, BS: tl.constexpr,
                   MQ: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr):
        """Unit (KV head, chunk) attends its KV head's query heads over keys lo .. hi: the first block (kk1 .. seen)
        was loaded before the barrier, and each next block is requested before the one in hand is used. Chunk 0
        stores the new token's K/V and counts it (it is always visible to itself). Returns the unnormalised
        (running max, sum, acc halves), [MQ] / [MQ, D/2]."""
        GQ: tl.constexpr = NH // NKV
        HALF: tl.constexpr = D // 2
        hk = pid // NC
        g = tl.arange(0, MQ)  # query heads of this KV head, padded to MQ rows for tl.dot
        gm = g < GQ
        heads = hk * GQ + g
        dh = tl.arange(0, HALF)
        pos = tl.load(pos_ptr)
        wslot = tl.load(wslot_ptr)
        angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + dh)
        cos, sin = tl.cos(angle), tl.sin(angle)
        q1 = tl.load(qkv_ptr + heads[:, None] * D + dh[None, :], mask=gm[:, None], other=0.0, cache_modifier=".cg")
        q2 = tl.load(qkv_ptr + heads[:, None] * D + HALF + dh[None, :], mask=gm[:, None], other=0.0, cache_modifier=".cg")
        kv = qkv_ptr + NH * D + hk * D
        k1, k2 = tl.load(kv + dh, cache_modifier=".cg"), tl.load(kv + HALF + dh, cache_modifier=".cg")
        v1 = tl.load(kv + NKV * D + dh, cache_modifier=".cg")
        v2 = tl.load(kv + NKV * D + HALF + dh, cache_modifier=".cg")
        rq = tl.rsqrt((tl.sum(q1 * q1, axis=1) + tl.sum(q2 * q2, axis=1)) / D + eps)[:, None]
        q1, q2 = _norm_rope(q1, q2, rq, tl.load(qn_ptr + dh).to(tl.float32)[None, :],
                            tl.load(qn_ptr + HALF + dh).to(tl.float32)[None, :], cos[None, :], sin[None, :])
        rk = tl.rsqrt((tl.sum(k1 * k1, axis=0) + tl.sum(k2 * k2, axis=0)) / D + eps)
        k1, k2 = _norm_rope(k1, k2, rk, tl.load(kn_ptr + dh).to(tl.float32), tl.load(kn_ptr + HALF + dh).to(tl.float32),
                            cos, sin)
        cache = tl.cast(layer, tl.int64) * cache_layer_stride
        first = (pid % NC) == 0
        if first:  # one unit per KV head stores the new token; no unit reads its slot (seen excludes it)
            here = cache + wslot.to(tl.int64) * cache_slot_stride + hk * D
            tl.store(k_ptr + here + dh, k1.to(k_ptr.dtype.element_ty))
            tl.store(k_ptr + here + HALF + dh, k2.to(k_ptr.dtype.element_ty))
            tl.store(v_ptr + here + dh, v1.to(v_ptr.dtype.element_ty))
            tl.store(v_ptr + here + HALF + dh, v2.to(v_ptr.dtype.element_ty))
        m = tl.where(first, (tl.sum(q1 * k1[None, :], axis=1) + tl.sum(q2 * k2[None, :], axis=1)) * scale, float("-inf"))
        den = tl.where(first, 1.0, 0.0) + tl.zeros((MQ,), tl.float32)
        acc1 = tl.where(first, 1.0, 0.0) * (tl.zeros((MQ, HALF), tl.float32) + v1[None, :])
        acc2 = tl.where(first, 1.0, 0.0) * (tl.zeros((MQ, HALF), tl.float32) + v2[None, :])
        for s0 in range(lo + BS, hi + BS, BS):  # block s0 - BS is in hand: request block s0 (none past hi), then use it
            nk1, nk2, nv1, nv2, nseen = _kv_block(k_ptr, v_ptr, cache, cache_slot_stride, slots_ptr, mask_ptr, wslot,
                                                  s0, hi, hk, BS, D)
            m, den, acc1, acc2 = _attend(q1, q2, kk1, kk2, vv1, vv2, seen, m, den, acc1, acc2, scale, USE_DOT, PREC)
            kk1, kk2, vv1, vv2, seen = nk1, nk2, nv1, nv2, nseen
        return m, den, acc1, acc2

    @triton.jit
    def _attn_partial_phase(pid, layer, kk1, kk2, vv1, vv2, seen, qkv_ptr, qn_ptr, kn_ptr, inv_freq_ptr, k_ptr, v_ptr,
                            cache_layer_stride, cache_slot_stride, pos_ptr, wslot_ptr, slots_ptr, mask_ptr, lo, hi, part_ptr,
                            eps, scale, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, NC: tl.constexpr,
                            BS: tl.constexpr, MQ: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr):
        """Unit (KV head, chunk) attends over its slice of the keys, lo .. hi, and stores the unnormalised partial:
        acc [GQ, D], then (running max, sum) per query head."""
        GQ: tl.constexpr = NH // NKV
        HALF: tl.constexpr = D // 2
        if pid < NKV * NC:
            m, den, acc1, acc2 = _attention(pid, layer, kk1, kk2, vv1, vv2, seen, qkv_ptr, qn_ptr, kn_ptr, inv_freq_ptr,
                                            k_ptr, v_ptr, cache_layer_stride, cache_slot_stride, pos_ptr, wslot_ptr,
                                            slots_ptr, mask_ptr, lo, hi, eps, scale, NH, NKV, D, NC, BS, MQ,
                                            USE_DOT, PREC)
            g = tl.arange(0, MQ)
            gm = g < GQ
            dh = tl.arange(0, HALF)
            out = part_ptr + pid * GQ * (D + 2)
            tl.store(out + g[:, None] * D + dh[None, :], acc1, mask=gm[:, None])
            tl.store(out + g[:, None] * D + HALF + dh[None, :], acc2, mask=gm[:, None])
            tl.store(out + GQ * D + 2 * g, m, mask=gm)
            tl.store(out + GQ * D + 2 * g + 1, den, mask=gm)

    @triton.jit
    def _o_rows(wo1, wo2, o1, o2, pid, x_ptr, acc_ptr, H: tl.constexpr, NC: tl.constexpr, RO: tl.constexpr):
        """Unit (KV head, chunk) adds its rows of the o projection of its KV head's attention output (halves
        o1, o2 [GQ, D/2]) and, for KV head 0, the residual itself into the residual."""
        rows = (pid % NC) * RO + tl.arange(0, RO)
        y = tl.sum(tl.sum(wo1.to(tl.float32) * o1[None, :, :], axis=2), axis=1) \
            + tl.sum(tl.sum(wo2.to(tl.float32) * o2[None, :, :], axis=2), axis=1)
        if pid // NC == 0:  # the residual itself, once per row (the chunks of one KV head cover every row)
            y += tl.load(x_ptr + rows, mask=rows < H, other=0.0, cache_modifier=".cg")
        tl.atomic_add(acc_ptr + rows, y, mask=rows < H, sem="relaxed")

    @triton.jit
    def _attn_merge_phase(pid, wo1, wo2, x_ptr, acc_ptr, zero_ptr, part_ptr, H: tl.constexpr, HB: tl.constexpr,
                          NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, NC: tl.constexpr, NCB: tl.constexpr,
                          RO: tl.constexpr):
        """Unit (KV head, chunk) merges its KV head's NC partials by their log-sum-exp and adds its rows of the
        o projection."""
        GQ: tl.constexpr = NH // NKV
        HALF: tl.constexpr = D // 2
        if pid < NKV * NC:
            hk = pid // NC
            c = tl.arange(0, NCB)
            gq = tl.arange(0, GQ)
            dh = tl.arange(0, HALF)
            part = part_ptr + (hk * NC + c)[:, None] * GQ * (D + 2)  # [NCB, 1]
            ok = (c < NC)[:, None]
            m = tl.load(part + GQ * D + 2 * gq[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")  # [NCB, GQ]
            den = tl.load(part + GQ * D + 2 * gq[None, :] + 1, mask=ok, other=0.0, cache_modifier=".cg")
            at = part[:, :, None] + gq[None, :, None] * D + dh[None, None, :]
            a1 = tl.load(at, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")  # [NCB, GQ, HALF]
            a2 = tl.load(at + HALF, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            top = tl.max(m, axis=0)  # finite: chunk 0 holds the new token
            w = tl.exp(m - top[None, :])
            total = tl.sum(den * w, axis=0)
            o1 = tl.sum(a1 * w[:, :, None], axis=0) / total[:, None]  # [GQ, HALF]
            o2 = tl.sum(a2 * w[:, :, None], axis=0) / total[:, None]
            _o_rows(wo1, wo2, o1, o2, pid, x_ptr, acc_ptr, H, NC, RO)
        _zero_next(pid, zero_ptr, H, HB)
