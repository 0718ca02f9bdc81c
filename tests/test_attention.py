"""LSE combine of shards equals full attention (docs/dcp.md, attention step 3)."""

import pytest
import torch

from qual.runtime.attention import attention_with_lse, combine_lse, global_lse, merge_attn_states


def full_attention(q, k, v, mask, scale):
    """Plain softmax attention in float64, one head group at a time."""
    H, Hk = q.shape[2], k.shape[2]
    kk = k.repeat_interleave(H // Hk, dim=2)
    vv = v.repeat_interleave(H // Hk, dim=2)
    s = torch.einsum("rthd,rshd->rhts", q, kk) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("rhts,rshd->rthd", p, vv)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_sharded_attention_combines_to_full(causal, shards):
    g = torch.Generator().manual_seed(shards + 10 * causal)
    R, T, S, H, Hk, D = 3, 5, 23, 4, 2, 8
    q = torch.randn(R, T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(R, S, Hk, D, generator=g, dtype=torch.float64)
    v = torch.randn(R, S, Hk, D, generator=g, dtype=torch.float64)
    qpos = torch.arange(S - T, S)
    mask = (torch.arange(S)[None, :] <= qpos[:, None]) if causal else torch.ones(T, S, dtype=torch.bool)
    mask = mask.expand(R, T, S)
    want = full_attention(q, k, v, mask, 0.3)
    owner = torch.randint(0, shards, (S,), generator=g)
    outs, lses = [], []
    for r in range(shards):
        o, l = attention_with_lse(q, k, v, mask & (owner == r), 0.3)
        outs.append(o)
        lses.append(l)
    got, lse = combine_lse(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    _, full_lse = attention_with_lse(q, k, v, mask, 0.3)
    torch.testing.assert_close(lse, full_lse)


def test_empty_shards_contribute_nothing():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    o, l = attention_with_lse(q, k, v, mask, 1.0)
    empty_o, empty_l = attention_with_lse(q, k, v, torch.zeros_like(mask), 1.0)
    assert torch.isinf(empty_l).all() and (empty_o == 0).all()
    for bad in (empty_l, torch.full_like(l, float("nan")), torch.full_like(l, float("inf"))):
        got, lse = combine_lse(torch.stack([o, empty_o, o * 0]), torch.stack([l, bad, bad]))
        torch.testing.assert_close(got, o)
        torch.testing.assert_close(lse, l)
    # every shard empty: output 0, lse -inf (no NaN leaks)
    got, lse = combine_lse(torch.stack([empty_o, empty_o]), torch.stack([empty_l, empty_l]))
    assert (got == 0).all() and torch.isinf(lse).all() and not torch.isnan(got).any()


def test_merge_two_partials_matches_formula():
    g = torch.Generator().manual_seed(1)
    o_p, o_s = torch.randn(2, 3, 4, generator=g, dtype=torch.float64), torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    p, s = torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randn(2, 3, generator=g, dtype=torch.float64)
    m = torch.maximum(p, s)
    want = (torch.exp(p - m)[..., None] * o_p + torch.exp(s - m)[..., None] * o_s) / (torch.exp(p - m) + torch.exp(s - m))[..., None]
    got, lse = merge_attn_states(o_p, p, o_s, s)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse, torch.logaddexp(p, s))
    torch.testing.assert_close(global_lse(torch.stack([p, s])), torch.logaddexp(p, s))
