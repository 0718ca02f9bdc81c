"""Triton attention over the paged KV store that also returns the log-sum-exp (DCP needs it).

Computes what qual/runtime/attention.py::attention_with_lse computes after KVStore.gather, in one
kernel: no gathered [R, S, kv_heads, D] copies, no [R, heads, Q, S] score tensors, one online
softmax in float32. A program covers one (request, KV head)'s group of query heads and every query
position of the request (decode: 1 + K tokens), walking the request's key slots in blocks. Long
contexts at small batches split each row's keys over several programs (flash-decoding), whose
partial results a second small kernel merges by their log-sum-exp.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

BLOCK_S = 64
# 8 warps a program: faster than 4 at the 0.6B shape's decode (8 KV heads, 128-wide; 1 or 8 rows of 160 or 1,000
# keys; one H200), with bit-identical results
NUM_WARPS = 8
MAX_ROWS = 256  # query heads per KV head x query positions in one program: decode steps, not prefill
MIN_SPLIT_KEYS = 128  # a key split walks at least this many of the static width


if triton is not None:

    @triton.jit
    def _store_result(out_ptr, lse_ptr, acc, m, l, r, qi, head, row_ok, d, so_r, so_q, so_h, sl_r, sl_q):
        """out = acc / l and lse = m + log l for the rows that saw a key; 0 and -inf for those that did not."""
        seen_any = l > 0
        out = tl.where(seen_any[:, None], acc / tl.where(seen_any, l, 1.0)[:, None], 0.0)
        lse = tl.where(seen_any, m + tl.log(tl.where(seen_any, l, 1.0)), float("-inf"))
        tl.store(out_ptr + r * so_r + qi[:, None] * so_q + head[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + r * sl_r + qi * sl_q + head, lse, mask=row_ok)

    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, mask_ptr, len_ptr, out_ptr, lse_ptr,
                                part_acc_ptr, part_ml_ptr, S, scale,
                                sq_r, sq_q, sq_h, sk_n, sk_h, ss_r, sm_r, sm_q, so_r, so_q, so_h, sl_r, sl_q,
                                Q: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr,
                                PDL: tl.constexpr):
        if PDL:  # everything read here (queries, keys, slots, mask) is earlier kernels' output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        r, hk, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
        length = tl.minimum(S, tl.load(len_ptr + r))  # keys past the row's length are padding: not even read
        # this program's share of the row's keys, whole blocks (splits past the row's keys get none)
        chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_S) * BLOCK_S
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, length)
        for s0 in range(lo, hi, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            s_ok = s < hi
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
        if SPLITS == 1:
            _store_result(out_ptr, lse_ptr, acc, m, l, r, qi, head, row_ok, d, so_r, so_q, so_h, sl_r, sl_q)
        else:  # unnormalised partials for _combine_kernel
            part = (r * tl.num_programs(1) + hk) * SPLITS + sp
            tl.store(part_acc_ptr + (part * BLOCK_M + rows[:, None]) * D + d[None, :], acc)
            tl.store(part_ml_ptr + (part * 2) * BLOCK_M + rows, m)
            tl.store(part_ml_ptr + (part * 2 + 1) * BLOCK_M + rows, l)

    @triton.jit
    def _combine_kernel(part_acc_ptr, part_ml_ptr, out_ptr, lse_ptr, so_r, so_q, so_h, sl_r, sl_q,
                        Q: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                        SPLITS: tl.constexpr, PDL: tl.constexpr):
        """Merges one (request, KV head)'s key splits: rescale each to the largest running max, then add."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        r, hk = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        g, qi = rows // Q, rows % Q
        row_ok = rows < G * Q
        d = tl.arange(0, D)
        first = (r * tl.num_programs(1) + hk) * SPLITS
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        for sp in tl.static_range(SPLITS):
            m = tl.maximum(m, tl.load(part_ml_ptr + ((first + sp) * 2) * BLOCK_M + rows))
        base = tl.where(m == float("-inf"), 0.0, m)
        l = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for sp in tl.static_range(SPLITS):
            part = first + sp
            w = tl.exp(tl.load(part_ml_ptr + (part * 2) * BLOCK_M + rows) - base)  # 0 for a split with no keys
            l += w * tl.load(part_ml_ptr + (part * 2 + 1) * BLOCK_M + rows)
            acc += w[:, None] * tl.load(part_acc_ptr + (part * BLOCK_M + rows[:, None]) * D + d[None, :])
        _store_result(out_ptr, lse_ptr, acc, m, l, r, qi, hk * G + g, row_ok, d, so_r, so_q, so_h, sl_r, sl_q)


@functools.lru_cache(maxsize=None)
def _programs_wanted(device: torch.device) -> int:
    """Two programs an SM keep the GPU's memory busy; the interpreter (CPU) takes a small GPU's count."""
    return 2 * (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8)


def key_splits(programs_wanted: int, rows: int, kv_heads: int, width: int) -> int:
    """How many programs share one (request, KV head)'s keys: enough to fill the GPU, a power of two (one
    compiled kernel each), never splits narrower than MIN_SPLIT_KEYS of the static key width."""
    n = max(1, min(programs_wanted // (rows * kv_heads), width // MIN_SPLIT_KEYS))
    return 1 << (n.bit_length() - 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    mask: torch.Tensor, scale: float, lengths: torch.Tensor | None = None, splits: int | None = None,
                    pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R, Q, H, D]; k/v_cache [slots, Hk, D]; slots [R, S]; mask [R, Q, S] bool (True = may attend).
    lengths [R] int32, optional: the mask is False from there on in each row, so those keys are not read
    (a CUDA graph's static S, up to max_model_len, costs only the keys a row has).
    splits: programs per (request, KV head), each over its share of the row's keys, merged by a second
    kernel (flash-decoding); default key_splits(), so long contexts at small batches fill the GPU.
    pdl: launched with programmatic dependent launch (qual/runtime/backends/skinny_gemm.py says how).

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
    splits = splits or key_splits(_programs_wanted(q.device), R, Hk, slots.shape[1])
    block_m = max(16, triton.next_power_of_2(G * Q))
    out = torch.empty_like(q)
    lse = torch.empty(R, Q, H, device=q.device, dtype=torch.float32)
    if splits > 1:  # the partials _combine_kernel merges; one split writes out and lse directly (lse: unused args)
        part_acc = torch.empty(R * Hk * splits * block_m * D, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(R * Hk * splits * 2 * block_m, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = lse
    if mask.dtype == torch.bool:
        mask = mask.view(torch.int8)  # same bytes; Triton loads int8
    if lengths is None:
        lengths = torch.full((R,), slots.shape[1], device=q.device, dtype=torch.int32)
    out_strides = (out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1))
    launch = {"launch_pdl": True} if pdl else {}
    _paged_attention_kernel[(R, Hk, splits)](
        q, k_cache, v_cache, slots, mask, lengths, out, lse, part_acc, part_ml, slots.shape[1], scale,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), slots.stride(0),
        mask.stride(0), mask.stride(1), *out_strides, Q=Q, G=G, D=D, BLOCK_M=block_m, BLOCK_S=BLOCK_S, SPLITS=splits,
        PDL=pdl, num_warps=NUM_WARPS, **launch)
    if splits > 1:
        _combine_kernel[(R, Hk)](part_acc, part_ml, out, lse, *out_strides, Q=Q, G=G, D=D, BLOCK_M=block_m,
                                 SPLITS=splits, PDL=pdl, **launch)
    return out, lse


if triton is not None:
    # A custom op: torch.compile keeps the launch as one node and traces around it.
    @torch.library.custom_op("qual::paged_attention", mutates_args=())
    def paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           mask: torch.Tensor, scale: float, lengths: torch.Tensor | None = None, pdl: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        return paged_attention(q, k_cache, v_cache, slots, mask, scale, lengths, pdl=pdl)

    @paged_attention_op.register_fake
    def _(q, k_cache, v_cache, slots, mask, scale, lengths=None, pdl=False):
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
