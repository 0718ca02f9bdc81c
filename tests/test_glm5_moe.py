"""The MoE's two dispatches: the graph-safe one (every expert on every token) sums what the sparse one does."""

import torch

from qual.runtime.models.glm5.moe import MoeWeights, every_expert, experts_hit, route


def test_every_expert_equals_experts_hit_in_float64():
    g = torch.Generator().manual_seed(0)
    E, H, I, T = 8, 16, 12, 37
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w = MoeWeights(router=r(E, H), bias=r(E) * 0.1, gate=r(E, I, H), up=r(E, I, H), down=r(E, H, I), shared=None,
                   top_k=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    x = r(T, H)
    weights, ids = route(w, x)
    assert ids.unique().numel() > 2  # several experts in play
    sparse = experts_hit(w, x, weights, ids, limit=7.0)
    dense = every_expert(w, x, weights, ids, limit=7.0)
    torch.testing.assert_close(dense, sparse, rtol=0, atol=1e-12)
    # an expert nobody chose contributes nothing: drop one chosen by some token and the sums move
    assert not torch.allclose(every_expert(w, x, weights * (ids != ids[0, 0]), ids, 7.0), sparse)
