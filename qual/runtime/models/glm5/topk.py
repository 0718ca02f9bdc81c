"""DSA pool selection with a deterministic total order, and its exact decomposition over DCP ranks.

Order: higher score first; equal scores (-0.0 == +0.0) keep the lower global pool id first. Scores are
finite (the indexer's ReLU-weighted sums). Because the order is total and ids are unique, a pool among the
global top-k has fewer than k pools ahead of it anywhere, so fewer than k on its owner rank: it is in its
owner's local top-k. Merging every rank's local top-k candidates with the same order therefore gives the
global top-k exactly, bit for bit equal to selecting on one rank (DCP 1 uses the same functions).
Padding: score -inf, id -1.
"""

from __future__ import annotations

import torch


def topk_pools(scores: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, k: int):
    """The k best valid candidates of each row, in selection order.

    scores [N, C] (finite where valid), ids [N, C] or [C] global pool ids (unique per row), valid [N, C] ->
    (scores [N, k], ids [N, k]); rows with fewer than k valid candidates are padded with (-inf, -1).
    """
    N, C = scores.shape
    ids = ids.expand(N, C) if ids.dim() == 1 else ids
    valid = valid & (ids >= 0)
    # Sort by id first, then stably by score: among equal scores the lower id stays in front.
    by_id = torch.argsort(torch.where(valid, ids, torch.iinfo(ids.dtype).max), dim=-1, stable=True)
    s = torch.where(valid, scores, torch.full_like(scores, float("-inf"))).gather(-1, by_id)
    s = s + 0.0  # -0.0 -> +0.0 so that both zeros tie
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    picked = by_id.gather(-1, order)[:, :k]
    ok = valid.gather(-1, picked)
    out_s = torch.where(ok, scores.gather(-1, picked), torch.full_like(picked, float("-inf"), dtype=scores.dtype))
    out_i = torch.where(ok, ids.gather(-1, picked), torch.full_like(picked, -1))
    if out_s.shape[1] < k:  # fewer candidates than k
        pad = k - out_s.shape[1]
        out_s = torch.cat([out_s, out_s.new_full((N, pad), float("-inf"))], 1)
        out_i = torch.cat([out_i, out_i.new_full((N, pad), -1)], 1)
    return out_s, out_i


def local_topk(scores: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, k: int):
    """A rank's top-k over the pools it holds: scores [N, P_local], their global ids [P_local] or [N, P_local],
    valid [N, P_local] (selectable by the query) -> (scores [N, k], ids [N, k])."""
    return topk_pools(scores, ids, valid, k)


def merge_topk(scores: torch.Tensor, ids: torch.Tensor, k: int):
    """Global top-k from every rank's local candidates, gathered along dim 1: scores/ids [N, ranks*k]."""
    return topk_pools(scores, ids, ids >= 0, k)


def union_topk(ids: torch.Tensor) -> torch.Tensor:
    """Union mode: each rank attends its own local top-k, no exchange. ids [ranks, N, k] -> the attended
    pools [N, ranks*k] sorted, -1 last (a superset of the global top-k: more than k pools)."""
    flat = ids.permute(1, 0, 2).reshape(ids.shape[1], -1)
    last = torch.iinfo(flat.dtype).max
    s = torch.where(flat >= 0, flat, last).sort(-1).values
    return s.masked_fill(s == last, -1)


def pool_owner(pool_ids: torch.Tensor, dcp_size: int, interleave: int = 1) -> torch.Tensor:
    """The DCP rank storing each pool: runs of `interleave` pools round-robin over the ranks."""
    return (pool_ids // interleave) % dcp_size
