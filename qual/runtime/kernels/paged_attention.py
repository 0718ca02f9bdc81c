"""Triton attention over the paged KV store that also returns the log-sum-exp (DCP needs it).

Computes what qual/runtime/attention.py::attention_with_lse computes after KVStore.gather, in one
kernel: no gathered [R, S, kv_heads, D] copies, no [R, heads, Q, S] score tensors, one online
softmax in float32. One program per (request, KV head) covers that head's group of query heads
and every query position of the request (decode: 1 + K tokens), walking the request's key slots
in blocks.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

BLOCK_S = 64
MAX_ROWS = 256  # query heads per KV head x query positions in one program: decode steps, not prefill


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, mask_ptr, len_ptr, out_ptr, lse_ptr, S, scale,
                                sq_r, sq_q, sq_h, sk_n, sk_h, ss_r, sm_r, sm_q, so_r, so_q, so_h, sl_r, sl_q,
                                Q: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
        r, hk = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)  # row = g * Q + query position
        g, qi = rows // Q, rows % Q
        row_ok = rows < G * Q
        head = hk * G + g
        d = tl.arange(0, D)
        q = tl.load(q_ptr + r * sq_r + qi[:, None] * sq_q + head[:, None] * sq_h + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        S = tl.minimum(S, tl.load(len_ptr + r))  # keys past the row's length are padding: not even read
        for s0 in range(0, S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            s_ok = s < S
            slot = tl.load(slots_ptr + r * ss_r + s, mask=s_ok, other=0)
            k = tl.load(k_ptr + slot[:, None] * sk_n + hk * sk_h + d[None, :], mask=s_ok[:, None], other=0.0)
            v = tl.load(v_ptr + slot[:, None] * sk_n + hk * sk_h + d[None, :], mask=s_ok[:, None], other=0.0)
            seen = tl.load(mask_ptr + r * sm_r + qi[:, None] * sm_q + s[None, :],
                           mask=row_ok[:, None] & s_ok[None, :], other=0) != 0
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp(scores - base[:, None])
            alpha = tl.exp(m - base)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m = m_new
        seen_any = l > 0
        out = tl.where(seen_any[:, None], acc / tl.where(seen_any, l, 1.0)[:, None], 0.0)
        lse = tl.where(seen_any, m + tl.log(tl.where(seen_any, l, 1.0)), float("-inf"))
        tl.store(out_ptr + r * so_r + qi[:, None] * so_q + head[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + r * sl_r + qi * sl_q + head, lse, mask=row_ok)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    mask: torch.Tensor, scale: float, lengths: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R, Q, H, D]; k/v_cache [slots, Hk, D]; slots [R, S]; mask [R, Q, S] bool (True = may attend).
    lengths [R] int32, optional: the mask is False from there on in each row, so those keys are not read
    (a CUDA graph's static S, up to max_model_len, costs only the keys a row has).

    Returns out [R, Q, H, D] in q's dtype and lse [R, Q, H] float32 (-inf, out 0 where nothing is visible).
    """
    R, Q, H, D = q.shape
    Hk = k_cache.shape[1]
    if H % Hk or D & (D - 1) or D < 16 or k_cache.stride(2) != 1 or q.stride(3) != 1 or slots.stride(1) != 1 \
            or mask.stride(2) != 1:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} cache {tuple(k_cache.shape)} "
                         "(need heads % kv_heads == 0, head_dim a power of 2 >= 16, unit inner strides)")
    G = H // Hk
    if G * Q > MAX_ROWS:
        raise ValueError(f"paged_attention: {G} query heads per KV head x {Q} positions > {MAX_ROWS} (decode only)")
    out = torch.empty_like(q)
    lse = torch.empty(R, Q, H, device=q.device, dtype=torch.float32)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.int8)  # same bytes; Triton loads int8
    if lengths is None:
        lengths = torch.full((R,), slots.shape[1], device=q.device, dtype=torch.int32)
    _paged_attention_kernel[(R, Hk)](
        q, k_cache, v_cache, slots, mask, lengths, out, lse, slots.shape[1], scale,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), slots.stride(0),
        mask.stride(0), mask.stride(1), out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        Q=Q, G=G, D=D, BLOCK_M=max(16, triton.next_power_of_2(G * Q)), BLOCK_S=BLOCK_S)
    return out, lse


if triton is not None:
    # A custom op: torch.compile keeps the launch as one node and traces around it.
    @torch.library.custom_op("qual::paged_attention", mutates_args=())
    def paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           mask: torch.Tensor, scale: float, lengths: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        return paged_attention(q, k_cache, v_cache, slots, mask, scale, lengths)

    @paged_attention_op.register_fake
    def _(q, k_cache, v_cache, slots, mask, scale, lengths=None):
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
