"""DSA: the selection order, its exact merge over DCP ranks, the pooled index keys and the tail ring."""

import pytest
import torch

from glm5_checkpoints import single_thread  # noqa: F401

from qual.runtime.models.glm5 import dsa
from qual.runtime.models.glm5.dsa import (IndexerWeights, IndexKeyCache, append_index_keys, compress_pools,
                                          expand_pools, new_index_cache, pairwise_sum, pool_scores, select_tokens,
                                          selection_mask, tail_ring_size)
from qual.runtime.models.glm5.topk import local_topk, merge_topk, pool_owner, topk_pools, union_topk

F64 = torch.float64


def test_equal_scores_keep_the_lower_id_first():
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.0, -0.0, 2.0, 7.0]])
    ids = torch.tensor([5, 3, 9, 1, 0, 4, 8])
    valid = torch.tensor([[True] * 6 + [False]])  # id 8 is not selectable despite its score
    s, i = topk_pools(scores, ids, valid, 8)
    assert i.tolist() == [[3, 4, 9, 5, 0, 1, -1, -1]]  # -0.0 and +0.0 tie: id 0 first
    assert s[0, :4].tolist() == [2.0, 2.0, 2.0, 1.0] and s[0, 6:].eq(float("-inf")).all()


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_pool_score_has_the_same_bits_whichever_pools_are_scored_beside_it(dtype, device, monkeypatch):
    """Each rank scores the pools it holds: a pool's score must not depend on how many pools a rank holds, which
    ones, or how the scorer chunks them (a GEMM's rounding does: shards of this size differ in the last bits from the
    whole in both dtypes). Then a near-tie at the k-th pool is decided the same way at every DCP size."""
    g = torch.Generator().manual_seed(3)
    R, Q, Hi, Di, P = 3, 5, 6, 24, 37
    q, hw, keys = (torch.randn(*shape, generator=g, dtype=dtype).to(device)
                   for shape in ((R, Q, Hi, Di), (R, Q, Hi), (R, P, Di)))
    whole = pool_scores(q, hw, keys.unsqueeze(1))  # [R, Q, P]
    expected = ((q.unsqueeze(-2) * keys[:, None, None]).sum(-1) * Di**-0.5).relu().mul(hw[..., None]).sum(-2)
    torch.testing.assert_close(whole, expected)  # the math is the indexer's
    for dcp, interleave in ((2, 1), (3, 2), (4, 1), (4, 3)):
        for rank in range(dcp):
            held = ((torch.arange(P) // interleave) % dcp == rank).to(device)
            assert torch.equal(pool_scores(q, hw, keys[:, held].unsqueeze(1)), whole[..., held])
    monkeypatch.setattr(dsa, "_SCORE_CHUNK", 2 * Q * Hi * Di + 1)  # two pools a chunk per request row
    assert torch.equal(pool_scores(q, hw, keys.unsqueeze(1)), whole)


def test_pairwise_sum_order_depends_on_the_length_alone():
    x = torch.tensor([[1e16, 1.0, -1e16, 1.0, 3.0]], dtype=F64)
    assert pairwise_sum(x, -1).item() == ((1e16 + -1e16) + (1.0 + 1.0)) + 3.0
    assert torch.equal(pairwise_sum(x.expand(4, 5), 1), pairwise_sum(x, 1).expand(4))


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (3, 2), (4, 1), (4, 3)])
def test_merging_local_topk_over_shards_is_the_global_topk(dcp, interleave):
    """Heavily tied scores (integers 0..4), random validity: merge(local top-k per rank) == top-k on one rank,
    bit for bit; the same functions at DCP 1 are the identity merge."""
    g = torch.Generator().manual_seed(dcp * 10 + interleave)
    N, P, k = 9, 61, 6
    scores = torch.randint(0, 5, (N, P), generator=g).to(torch.float32)
    valid = torch.rand(N, P, generator=g) < 0.8
    perm = torch.randperm(P, generator=g)  # a random id for each stored pool: ownership is not contiguous
    want_s, want_i = local_topk(scores, perm, valid, k)
    owner = pool_owner(perm, dcp, interleave)
    parts = [local_topk(scores[:, owner == r], perm[owner == r], valid[:, owner == r], k) for r in range(dcp)]
    got_s, got_i = merge_topk(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1), k)
    assert torch.equal(got_i, want_i) and torch.equal(got_s, want_s)
    one_s, one_i = merge_topk(want_s, want_i, k)
    assert torch.equal(one_i, want_i) and torch.equal(one_s, want_s)


def test_union_keeps_every_rank_local_topk():
    """Rank 0 holds the even pools, all better than rank 1's odd ones: the exact top-2 are rank 0's best two,
    the union adds rank 1's best two as well."""
    ids = torch.arange(8)
    scores = torch.where(ids % 2 == 0, 10.0 + ids, 1.0 * ids)[None].to(torch.float32)
    valid = torch.ones(1, 8, dtype=torch.bool)
    parts = [local_topk(scores[:, ids % 2 == r], ids[ids % 2 == r], valid[:, :4], 2) for r in range(2)]
    exact = merge_topk(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1), 2)[1]
    union = union_topk(torch.stack([p[1] for p in parts]))
    assert exact.tolist() == [[6, 4]] and union.tolist() == [[4, 5, 6, 7]]
    assert set(exact[0].tolist()) < set(union[0].tolist())


def _keys(T, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, generator=g, dtype=F64), torch.randn(T, D, generator=g, dtype=F64)


def _cache(kpool, ring, D=8):
    z = lambda n: torch.zeros(n, D, dtype=F64)  # noqa: E731
    return IndexKeyCache(z(0), z(ring), z(ring))


def test_pooled_keys_do_not_depend_on_how_positions_arrive():
    kpool, T = 4, 37
    k, gate = _keys(T)
    ape = torch.randn(kpool, 8, generator=torch.Generator().manual_seed(9), dtype=F64)
    direct = compress_pools(k[:36].view(9, kpool, 8), gate[:36].view(9, kpool, 8), ape)
    whole = append_index_keys(_cache(kpool, 8), 0, k, gate, ape)
    c, at = _cache(kpool, 8), 0
    for n in (3, 1, 10, 5, 18):  # starts not aligned to pools
        c = append_index_keys(c, at, k[at:at + n], gate[at:at + n], ape)
        at += n
    assert torch.allclose(whole.pooled, direct, rtol=0, atol=1e-14)
    assert torch.allclose(c.pooled, direct, rtol=0, atol=1e-14)
    # the ring holds the raw key of the in-progress pool (position 36) at slot 36 % 8
    assert torch.equal(c.ring_k[36 % 8], k[36])


@pytest.mark.parametrize("ring", [tail_ring_size(4, 3), 4])
def test_tail_ring_survives_a_rejected_pool_completing_draft(ring):
    """33 committed positions, a verify of 4 (position 35, the third, completes pool 8) keeps 2; the redo
    recompresses pool 8 from positions 32..34 still in the ring. A one-pool ring has lost position 32 to the
    rejected draft at 36 by then."""
    kpool = 4
    k, gate = _keys(40, seed=1)
    bad_k, bad_g = _keys(4, seed=2)  # the drafts, two of them rejected
    ape = torch.zeros(kpool, 8, dtype=F64)
    c = append_index_keys(_cache(kpool, ring), 0, k[:33], gate[:33], ape)
    c = append_index_keys(c, 33, torch.cat([k[33:35], bad_k[2:]]), torch.cat([gate[33:35], bad_g[2:]]), ape)
    c = append_index_keys(c, 35, k[35:39], gate[35:39], ape)  # the redo
    want = compress_pools(k[32:36].view(1, kpool, 8), gate[32:36].view(1, kpool, 8), ape)[0]
    assert torch.allclose(c.pooled[8], want, rtol=0, atol=1e-14) == (ring >= kpool + 3)
    assert tail_ring_size(4, 3) == 8 and tail_ring_size(16, 0) == 16 and tail_ring_size(16, 3) == 32
    assert tail_ring_size(4, 5) == 16


def test_expand_pools_appends_the_visible_tail():
    pools = torch.tensor([[1, 0], [2, -1]])
    got = expand_pools(pools, torch.tensor([10, 11]), 4, tail=True)
    assert got.tolist() == [[4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10], [8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1]]
    assert expand_pools(pools, torch.tensor([10, 11]), 4, tail=False).shape == (2, 8)
    mask = selection_mask(got, torch.tensor([0, 3, 7, 8, 11]), 12)
    assert mask.tolist() == [[True, True, True, True, False], [False, False, False, True, True]]


def test_selection_is_causal_and_sized_by_topk():
    g = torch.Generator().manual_seed(3)
    Di, Hi, kpool, P = 8, 16, 4, 12
    z = lambda *shape: torch.zeros(*shape, dtype=F64)  # noqa: E731 (only the sizes matter here)
    w = IndexerWeights(wq_b=z(Hi * Di, 4), wk=z(Di, 4), k_norm_weight=z(Di), k_norm_bias=z(Di), weights_proj=z(Hi, 4),
                       compress_gate=z(Di, 4), compress_ape=z(kpool, Di), select_pools=3, select_tail=True)
    q_pos = torch.arange(0, 50)
    q = torch.randn(50, Hi, Di, generator=g, dtype=F64)
    head_w = torch.randn(50, Hi, generator=g, dtype=F64)
    tokens, pools, margin = select_tokens(w, q, head_w, torch.randn(P, Di, generator=g, dtype=F64), q_pos)
    for p in range(50):
        t = tokens[p][tokens[p] >= 0]
        complete = (p + 1) // kpool
        assert (t <= p).all() and t.unique().numel() == t.numel()
        assert t.numel() == min(3, complete) * kpool + (p + 1) % kpool
        assert (p + 1) % kpool == 0 or (t == p).any()  # a query always sees itself through its tail
        assert margin[p] == float("inf") or complete > 3
    assert (margin[q_pos >= 15] < float("inf")).all() and (margin[q_pos >= 15] > 0).all()
    # before the first complete pool only the tail is attended
    early, none, _ = select_tokens(w, q[:3], head_w[:3], torch.zeros(0, Di, dtype=F64), q_pos[:3])
    assert none.eq(-1).all() and [sorted(t[t >= 0].tolist()) for t in early] == [[0], [0, 1], [0, 1, 2]]
    ring = new_index_cache(w, tail_ring_size(kpool, 2), F64)
    assert ring.ring_k.shape == (8, Di) and ring.pooled.shape == (0, Di)
