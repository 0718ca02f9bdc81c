"""Attention that returns its log-sum-exp, and the DCP combine of partial results (docs/dcp.md, "Attention under DCP")."""

from __future__ import annotations

import torch


def attention_with_lse(
    q: torch.Tensor,  # [R, T, H, D]
    k: torch.Tensor,  # [R, S, Hk, D]
    v: torch.Tensor,  # [R, S, Hk, Dv]
    mask: torch.Tensor,  # [R, T, S] True = may attend
    scale: float,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention; returns out [R, T, H, Dv] and lse [R, T, H] (-inf, out 0 where nothing is visible).

    PyTorch's operators step by step; with `fused`, where fused_applies, one kernel computes the same (the step-by-step
    path is its reference: tests/test_gpu.py). Prefill asks for it: its scores [R, H, T, S] are large and run
    eagerly or replayed from a graph as they are. A decode step's are a verify block's rows, and torch.compile fuses
    the step-by-step operators into fewer kernels than the fused one costs there (the toy pair's compiled step on one
    H200: 0.379 ms, 0.442 ms with the fused kernel)."""
    if fused and fused_applies(q, k, v):
        return _fused_attention_with_lse(q, k, v, mask, scale)
    R, T, H, D = q.shape
    Hk = k.shape[2]
    group = H // Hk
    qg = q.view(R, T, Hk, group, D).permute(0, 2, 3, 1, 4)  # [R, Hk, G, T, D]
    kk = k.permute(0, 2, 3, 1)  # [R, Hk, D, S]
    scores = torch.matmul(qg, kk.unsqueeze(2)) * scale  # [R, Hk, G, T, S]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [R, Hk, G, T]
    # A row with nothing visible has lse = -inf and exp(-inf - -inf) = NaN: make those probabilities 0.
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(nan=0.0)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).unsqueeze(2))  # [R, Hk, G, T, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(R, T, H, v.shape[-1])
    lse = lse.permute(0, 3, 1, 2).reshape(R, T, H)
    return out, lse


FUSED_DTYPES = (torch.bfloat16, torch.float16)


def fused_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether attention_with_lse runs as one kernel: PyTorch's memory-efficient attention on CUDA, in half precision
    (in float32 and float64 the step-by-step operators keep the CPU's numbers), keys and values of one head width
    up to 128 (the widths that kernel takes), and some key to attend to.

    Why: step by step, the scores [R, H, T, S] cross memory about ten times (mask, log-sum-exp, exp, the NaN guard,
    the product with V): in a prefill of 8 prompts padded to 512 tokens that was most of the prefill's device time
    (the toy pair's 2.83 ms a replay on one H200; 1.59 ms fused), and a stream's decode steps wait behind it
    (docs/PERFORMANCE.md)."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in FUSED_DTYPES and k.shape[-1] == d == v.shape[-1] and d % 8 == 0 and d <= 128
            and k.shape[1] > 0)


def _fused_attention_with_lse(q, k, v, mask, scale):
    """attention_with_lse in one kernel (fused_applies): the mask as an additive bias, the kernel's log-sum-exp."""
    R, T, H, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    if H != Hk:  # the kernel takes one key head per query head: each KV head serves its group of query heads
        k, v = k.repeat_interleave(H // Hk, dim=2), v.repeat_interleave(H // Hk, dim=2)
    # The kernel reads the bias row by row at a stride of a multiple of 16 elements: a wider buffer, cut to S
    width = -(-S // 16) * 16
    bias = torch.full((R, T, width), float("-inf"), dtype=q.dtype, device=q.device)[..., :S]
    bias.masked_fill_(mask, 0.0)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias[:, None].expand(R, H, T, S), True,
        scale=scale)[:2]
    # A row that sees nothing: out 0 and lse -inf, as the step-by-step path gives them (the kernel's may be NaN)
    blind = ~mask.any(dim=-1)[..., None]  # [R, T, 1]
    out = out.transpose(1, 2).masked_fill(blind[..., None], 0.0)
    lse = lse[..., :T].transpose(1, 2).masked_fill(blind, float("-inf"))  # the kernel pads its rows to 32
    return out, lse.to(q.dtype)


def _clean_lse(lse: torch.Tensor) -> torch.Tensor:
    # An empty shard reports -inf; NaN / +inf are treated the same so they contribute nothing.
    bad = torch.isnan(lse) | (lse == float("inf"))
    return lse.masked_fill(bad, float("-inf"))


def global_lse(lses: torch.Tensor) -> torch.Tensor:
    """LSE over N partial results [N, ...]: m + log sum exp(lse_r - m); -inf where every shard is empty."""
    lses = _clean_lse(lses)
    m = lses.max(dim=0).values
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.exp(lses - m_safe).sum(dim=0)
    return torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, float("-inf")))


def combine_lse(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial attentions: outs [N, ..., D], lses [N, ...] -> (out [..., D], lse [...])."""
    lse = global_lse(lses)
    out = torch.stack([rescale_to_global(o, l, lse) for o, l in zip(outs, lses)]).sum(dim=0)
    return out, lse


def rescale_to_global(out: torch.Tensor, lse: torch.Tensor, global_lse: torch.Tensor) -> torch.Tensor:
    """This shard's share of the combined output: O_r * exp(lse_r - LSE) (summed over ranks gives O)."""
    lse = _clean_lse(lse)
    w = torch.exp(lse - torch.where(torch.isfinite(global_lse), global_lse, torch.zeros_like(global_lse)))
    w = torch.where(torch.isfinite(lse) & torch.isfinite(global_lse), w, torch.zeros_like(w))
    return out * w.unsqueeze(-1)


def merge_attn_states(
    o_p: torch.Tensor, lse_p: torch.Tensor, o_s: torch.Tensor, lse_s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results (prefix, suffix) with the same rule as the DCP combine."""
    return combine_lse(torch.stack([o_p, o_s]), torch.stack([lse_p, lse_s]))
