"""RoPE as the runtime applies it (layers.Rope: cos/sin once a forward, rotate-half by a roll against a sin whose
first half is negated) equals transformers' apply_rotary_pos_emb bit for bit, in every dtype the runtime runs."""

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from qual.runtime.models.layers import Rope, rope_cos_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rope_is_transformers_rotate_half_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    T, H, D = 9, 4, 64
    q, k = (torch.randn(T, H, D, generator=g).to(dtype) for _ in range(2))
    positions = torch.tensor([0, 1, 2, 3, 40, 41, 700, 701, 4095])
    rope = Rope(D, 1e6, None, dtype)
    cos, sin = rope_cos_sin(positions, rope.inv_freq, dtype)  # transformers' cos/sin: each frequency twice
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(rope(q, positions), hf_q[0].transpose(0, 1))
    assert torch.equal(rope(k, positions), hf_k[0].transpose(0, 1))  # the second call uses the cached cos/sin
