"""Attention that returns its log-sum-exp, and the DCP combine of partial results (docs/dcp.md, "Attention under DCP")."""

from __future__ import annotations

import torch


def attention_with_lse(
    q: torch.Tensor,  # [R, T, H, D]
    k: torch.Tensor,  # [R, S, Hk, D]
    v: torch.Tensor,  # [R, S, Hk, Dv]
    mask: torch.Tensor,  # [R, T, S] True = may attend
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention; returns out [R, T, H, Dv] and lse [R, T, H] (-inf, out 0 where nothing is visible)."""
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
