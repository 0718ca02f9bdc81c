"""One sparse MLA step decomposed over DCP ranks, as a paged engine runs it.

Each rank stores the pooled index keys and the latents of the pools it owns (a pool's tokens live with its
key). Exact mode: every rank scores its own pools, the local top-k candidates are all-gathered and merged,
then every rank attends the selected tokens it holds and the partial (out, lse) are merged: this must equal
DCP 1. Union mode skips the candidate exchange: each rank attends its own local top-k.
"""

import pytest
import torch

from glm5_checkpoints import single_thread  # noqa: F401

from qual.runtime.attention import combine_lse
from qual.runtime.models.glm5.dsa import (IndexerWeights, expand_pools, pool_scores, select_tokens, selectable_pools,
                                          selection_mask)
from qual.runtime.models.glm5.mla import latent_attention
from qual.runtime.models.glm5.topk import local_topk, merge_topk, pool_owner

F64 = torch.float64
KPOOL, DI, HI, H, L = 4, 8, 16, 3, 12


def _step(seed, S=70, Q=4):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    z = lambda *s: torch.zeros(*s, dtype=F64)  # noqa: E731
    w = IndexerWeights(wq_b=z(HI * DI, 4), wk=z(DI, 4), k_norm_weight=z(DI), k_norm_bias=z(DI), weights_proj=z(HI, 4),
                       compress_gate=z(DI, 4), compress_ape=z(KPOOL, DI), select_pools=3, select_tail=True)
    q_pos = torch.arange(S - Q, S)  # a verify of Q tokens at the end of an S-token sequence
    return w, r(Q, HI, DI), r(Q, HI), r(S // KPOOL, DI), r(Q, H, L), r(S, L), q_pos


def _token_owner(S, dcp, interleave=1):
    """A token lives with its pool (the in-progress pool too): [S] rank of each position."""
    return pool_owner(torch.arange(S) // KPOOL, dcp, interleave)


def _attend(q_lat, latents, mask):
    out, lse = latent_attention(q_lat[None], latents[None], mask[None], L**-0.5, L)
    return out[0], lse[0]


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (3, 1), (4, 2)])
def test_exact_dcp_selection_and_attention_equal_dcp1(dcp, interleave):
    w, q, head_w, pooled, q_lat, latents, q_pos = _step(dcp)
    S = latents.shape[0]
    tokens, want_pools, _ = select_tokens(w, q, head_w, pooled, q_pos)
    want, _ = _attend(q_lat, latents, selection_mask(tokens, torch.arange(S), S))

    pools = torch.arange(pooled.shape[0])
    owner = pool_owner(pools, dcp, interleave)
    token_owner = _token_owner(S, dcp, interleave)
    cands = []
    for rank in range(dcp):  # each rank scores the pools it holds
        mine = pools[owner == rank]
        scores = pool_scores(q, head_w, pooled[mine])
        cands.append(local_topk(scores, mine, selectable_pools(q_pos, mine, KPOOL), w.select_pools))
    # all-gather of (score, global id) candidates, then the same merge on every rank
    _, merged = merge_topk(torch.cat([c[0] for c in cands], 1), torch.cat([c[1] for c in cands], 1), w.select_pools)
    assert torch.equal(merged, want_pools)
    sel = expand_pools(merged, q_pos, KPOOL, tail=True)
    parts = []
    for rank in range(dcp):  # each rank attends the selected tokens it holds
        held = torch.nonzero(token_owner == rank).squeeze(1)
        parts.append(_attend(q_lat, latents[held], selection_mask(sel, held, S)))
    got, _ = combine_lse(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert (got - want).abs().max() < 1e-12


def test_union_mode_attends_every_rank_local_topk():
    w, q, head_w, pooled, q_lat, latents, q_pos = _step(7)
    S, dcp = latents.shape[0], 2
    pools = torch.arange(pooled.shape[0])
    owner = pool_owner(pools, dcp)
    token_owner = _token_owner(S, dcp)
    parts, union = [], torch.zeros(q_pos.numel(), S, dtype=torch.bool)
    for rank in range(dcp):
        mine = pools[owner == rank]
        _, top = local_topk(pool_scores(q, head_w, pooled[mine]), mine, selectable_pools(q_pos, mine, KPOOL), 3)
        held = torch.nonzero(token_owner == rank).squeeze(1)
        sel = expand_pools(top, q_pos, KPOOL, tail=True)
        union |= selection_mask(sel, torch.arange(S), S) & (token_owner == rank)
        parts.append(_attend(q_lat, latents[held], selection_mask(sel, held, S)))
    got, _ = combine_lse(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    want, _ = _attend(q_lat, latents, union)
    assert (got - want).abs().max() < 1e-12
    tokens, _, _ = select_tokens(w, q, head_w, pooled, q_pos)
    exact = selection_mask(tokens, torch.arange(S), S)
    assert (exact & ~union).sum() == 0 and union.sum() > exact.sum()  # a strict superset: a different result
    assert (got - _attend(q_lat, latents, exact)[0]).abs().max() > 1e-3
