"""The invariant merge (qual/runtime/dcp_invariant.py) on plain tensors: DCP N's ranks, each holding its keys in the
order the paged cache lays them out, merge to DCP 1's bits; the summation pieces it rests on; the configurations it
refuses. The same on real rank processes: tests/test_runtime_dcp.py (Qwen3) and tests/test_glm5_runtime.py (GLM)."""

from __future__ import annotations

import re

import pytest
import torch

from qual.errors import QualError
from qual.runtime.attention import attention_with_lse
from qual.runtime.config import DCP_VIRTUAL_SHARDS, EngineConfig, ParallelConfig
from qual.runtime.dcp_invariant import finish, local_partials, merge_halves, merge_tree, shard_partials, tree_sum
from qual.runtime.geometry import local_index_positions

V = DCP_VIRTUAL_SHARDS


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="needs CUDA")])]


def _step(dtype, seed=0, R=3, Q=4, H=8, Hk=1, D=16, Dv=12, lengths=(37, 50, 9), device="cpu"):
    """A verify step of Q queries at the end of each request: q [R, Q, H, D], keys and values of every position,
    a causal mask that also drops about a third of the keys (a sparse selection)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).to(device)  # noqa: E731
    S = max(lengths)
    L = torch.tensor(lengths)
    q_pos = L[:, None] - Q + torch.arange(Q)
    pos = torch.arange(S)
    mask = (pos <= q_pos[..., None]) & (pos < L[:, None, None]) & (torch.rand(R, Q, S, generator=g) < 0.7)
    return r(R, Q, H, D), r(R, S, Hk, D), r(R, S, Hk, Dv), mask.to(device)


def _dcp(q, k, v, mask, N, interleave, block_size=4, extra=0, heads=None):
    """The merged output [R, Q, H, Dv] of N ranks: each rank's local keys in the paged cache's local order (the
    inverse of its slot map), `extra` stale keys past them (a wider key view), its partials over all H query heads;
    then the all-to-all (rank j gets heads j*H/N ..) and the last levels of the tree. heads: which query heads the
    step holds (another batch shape), all by default."""
    R, Q, H, _ = q.shape
    S = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    g = torch.Generator().manual_seed(99)
    parts = []
    for rank in range(N):
        local = local_index_positions(S, block_size, N, rank, interleave)
        local = local[local < S]
        stale = lambda t: torch.randn(R, extra, *t.shape[2:], generator=g, dtype=torch.float64).to(t)  # noqa: E731
        kl, vl = torch.cat([k[:, local], stale(k)], 1), torch.cat([v[:, local], stale(v)], 1)
        ml = torch.cat([mask[:, :, local], torch.zeros(R, Q, extra, dtype=torch.bool, device=mask.device)], 2)
        qh = q if heads is None else q[:, :, heads]
        parts.append(local_partials(qh.to(acc), kl.to(acc), vl.to(acc), ml, 0.3, V // N, interleave))
    per = parts[0].shape[2] // N
    outs = [finish(merge_tree(torch.stack([p[:, :, j * per:(j + 1) * per] for p in parts]), 0)) for j in range(N)]
    return torch.cat(outs, 2).to(q.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("interleave", [1, 2, 4])
@pytest.mark.parametrize("Hk", [1, 2])
def test_every_dcp_size_merges_to_dcp_1s_bits(dtype, interleave, Hk, device):
    """DCP 2, 4 and 8 equal DCP 1 bit for bit, whatever the interleave, the key view's width (stale keys past the
    local ones) and the GQA grouping; and DCP 1 is attention (float64 attention_with_lse to its dtype's rounding).
    On a GPU: the shard math of N ranks in one process (NCCL takes one rank per GPU)."""
    q, k, v, mask = _step(dtype, Hk=Hk, device=device)
    base = _dcp(q, k, v, mask, 1, interleave)
    for N in (2, 4, 8):
        assert torch.equal(_dcp(q, k, v, mask, N, interleave, extra=3 * N), base), N
    want, _ = attention_with_lse(*(t.double() for t in (q, k, v)), mask, 0.3)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert (base.double() - want).abs().max() < tol


def test_the_merge_path_a2a_would_not_be_bit_for_bit():
    """What the test above rules out: merging each rank's attention_with_lse by its LSE (a2a's combine) rounds
    differently from DCP 1's one softmax in float32 (the check can fail)."""
    from qual.runtime.attention import combine_lse

    q, k, v, mask = _step(torch.float32)
    base, _ = attention_with_lse(q, k, v, mask, 0.3)
    S = k.shape[1]
    parts = []
    for rank in range(4):
        local = local_index_positions(S, 4, 4, rank, 1)
        local = local[local < S]
        parts.append(attention_with_lse(q, k[:, local], v[:, local], mask[:, :, local], 0.3))
    merged, _ = combine_lse(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert not torch.equal(merged, base)


def test_a_shards_partial_depends_on_its_own_query_and_keys_alone():
    """The batch's shape does not reach the bits: a request alone, or beside others, with some of the query heads or
    all of them, gets the same output."""
    q, k, v, mask = _step(torch.float32)
    whole = _dcp(q, k, v, mask, 2, 1)
    alone = _dcp(q[1:2], k[1:2], v[1:2], mask[1:2], 2, 1)
    assert torch.equal(alone, whole[1:2])
    some = _dcp(q, k, v, mask, 2, 1, heads=[0, 1, 4, 5])  # each rank's pair of heads: a batch of 4 heads
    assert torch.equal(some, whole[:, :, [0, 1, 4, 5]])


def test_tree_sum_pairs_by_index_so_appended_zeros_change_nothing():
    x = torch.randn(5, 13, dtype=torch.float32)
    s = tree_sum(x, 1)
    for pad in (1, 3, 19, 51):
        assert torch.equal(tree_sum(torch.cat([x, torch.zeros(5, pad)], 1), 1), s)
    assert torch.equal(tree_sum(x[2:3], 1), s[2:3])  # neighbouring rows change nothing either
    # the pairing spelled out: ((x0 + x1) + (x2 + x3)) + x4
    y = torch.randn(5, dtype=torch.float32)
    assert torch.equal(tree_sum(y, 0), ((y[0] + y[1]) + (y[2] + y[3])) + y[4])
    assert torch.equal(tree_sum(torch.arange(10.0).view(2, 5), 0), torch.tensor([5.0, 7, 9, 11, 13]))


def test_the_merge_tree_pairs_v_with_v_plus_half_then_quarter():
    """The documented tree: (0, 4), (1, 5), (2, 6), (3, 7), then (0, 2), (1, 3), then (0, 1); an empty shard (max
    -inf, sum 0) adds nothing."""
    q, k, v, mask = _step(torch.float32, R=1, Q=2)
    from qual.runtime.dcp_invariant import by_shard

    kk, vv, mm = by_shard(k, 1, V, 1, 0), by_shard(v, 1, V, 1, 0), by_shard(mask, 2, V, 1, False)
    parts = shard_partials(q.view(1, 2, 1, 8, 16), kk, vv, mm, 0.3)  # [R, Q, V, Hk, G, Dv + 2]
    p = [parts[:, :, i] for i in range(V)]
    pair = lambda a, b: merge_halves(torch.stack([a, b], 2), 2).squeeze(2)  # noqa: E731
    by_hand = pair(pair(pair(p[0], p[4]), pair(p[2], p[6])), pair(pair(p[1], p[5]), pair(p[3], p[7])))
    assert torch.equal(merge_tree(parts, 2), by_hand)
    empty = torch.cat([torch.zeros_like(p[0][..., :-2]), torch.full_like(p[0][..., -2:-1], float("-inf")),
                       torch.zeros_like(p[0][..., -1:])], -1)
    assert torch.equal(pair(p[3], empty), p[3])


def test_configurations_the_invariant_merge_refuses():
    for dcp in (3, 6):
        with pytest.raises(QualError, match=f"dcp_comm invariant: dcp={dcp} must divide the {V} virtual shards"):
            ParallelConfig(dcp, dcp, 1, "invariant")
    assert ParallelConfig(8, 8, 1, "invariant").admission_dcp == 1
    assert ParallelConfig(4, 4, 1, "a2a").admission_dcp == 4  # admission at the engine's own DCP size
    for backend, why in (("triton-attention", "computes the target's attention itself"),
                         ("triton-gemm+fused", "computes the target's attention itself"),
                         ("compiled", "rests on every operator rounding on its own"),
                         ("triton-gemm+compiled-prefill", "rests on every operator rounding on its own")):
        with pytest.raises(QualError, match=re.escape(f"backend {backend}: dcp_comm invariant {why}")):
            EngineConfig("t", parallel=ParallelConfig(1, 1, 1, "invariant"), backend=backend, device="cuda",
                         dtype="bfloat16", static_shapes=True)
    EngineConfig("t", parallel=ParallelConfig(1, 1, 1, "invariant"), backend="triton-gemm", device="cuda",
                 dtype="bfloat16")  # projections: the same GEMM at every DCP size
