"""Tiny random GLM-5.3-Flash checkpoints written by transformers, and transformers as the oracle."""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (Glm5NextConfig, Glm5NextForConditionalGeneration, Glm5NextTextConfig,  # noqa: E402
                          Glm5NextTextModel)

TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                   projection_intermediate_size=16)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny tensors on a shared 2-core machine: one intra-op thread is several times faster (restored after)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def tiny_text(**over) -> dict:
    """A small text config whose every path matters: 4 heads (tp 4 splits them), 16 index heads (ReLU zero
    ties stay improbable), pools of 4 with a top-k of 2 pools, clamps that bite."""
    cfg = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=2, topk_group=1,
               num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
               v_head_dim=8, index_topk=8, index_head_dim=8, index_n_heads=16, index_kpool=4, linear_head_dim=8,
               linear_num_heads=4, linear_conv_kernel_dim=4, hc_mult=4, hc_sinkhorn_iters=5, swiglu_limit=1.0,
               routed_scaling_factor=1.5, pad_token_id=0, eos_token_id=None)
    cfg.update(over)
    return cfg


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace transformers' init (zeros/ones for biases, norms, hc base/scale, ape, gate, A_log) by random values
    of a scale that keeps activations O(1), so that every parameter changes the output."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)  # noqa: E731
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "visual" in name or not p.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("dt_bias",):
                continue  # keep the inverse-softplus init of the step size
            if leaf == "scale":  # hc logit scales: positive
                p.copy_(0.5 + rnd(p).abs())
            elif leaf == "A_log":
                p.copy_(0.5 * rnd(p))
            elif p.dim() == 1 and (leaf == "weight"):  # norm weights
                p.copy_(1 + 0.2 * rnd(p))
            elif p.dim() == 1 or leaf == "index_kpool_compress_ape":
                p.copy_(0.5 * rnd(p))
            elif name.endswith("conv1d.weight"):
                p.copy_(rnd(p) / math.sqrt(p.shape[-1]))
            elif leaf == "embed_tokens" or name.endswith("embed_tokens.weight"):
                p.copy_(rnd(p))
            else:  # [.., out, in] matrices
                p.copy_(rnd(p) / math.sqrt(p.shape[-1]))


def make_glm5(path: Path, text: dict, composite: bool = True, tie: bool = False, seed: int = 0) -> Path:
    """Save a random model: Glm5NextForConditionalGeneration (with a vision tower) or a bare Glm5NextTextModel."""
    torch.manual_seed(seed)
    if composite:
        model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=TINY_VISION,
                                                                tie_word_embeddings=tie))
    else:
        model = Glm5NextTextModel(Glm5NextTextConfig(**text))
    _randomize(model, seed)
    if composite and tie:
        model.tie_weights()
    model.save_pretrained(str(path))
    return path


def oracle(path: Path):
    """The saved model in float64, eager attention and experts (every tensor float64, the fp32-kept ones too)."""
    cls = Glm5NextForConditionalGeneration if (path / "config.json").read_text().find('"glm5_next"') >= 0 \
        else Glm5NextTextModel
    model = cls.from_pretrained(str(path), dtype=torch.float64, attn_implementation="eager",
                                experts_implementation="eager")
    return model.to(torch.float64).eval()


@contextmanager
def float64_islands():
    """transformers computes norms, gates, router, MHC weights, KDA, index scores and the softmax in float32 even
    in a float64 model; raise those casts to float64 so the comparison tests the math, not float32 rounding."""
    mod = sys.modules[Glm5NextTextModel.__module__]

    class _Float64Torch:
        def __getattr__(self, name):
            return torch.float64 if name in ("float32", "float") else getattr(torch, name)

    saved_torch, saved_float = mod.torch, torch.Tensor.float
    mod.torch = _Float64Torch()
    torch.Tensor.float = lambda self, *a, **k: self.double()
    try:
        yield
    finally:
        mod.torch, torch.Tensor.float = saved_torch, saved_float


@contextmanager
def lowest_pool_wins_ties():
    """transformers' DSA indexer with qual's documented tie-break: among equal index scores the lower pool id is
    selected first. Its `index_scores.topk` leaves the order of equal values unspecified, and ties are real (ReLU
    makes exact-zero scores common with few index heads), so the oracle is pinned to the order qual promises."""
    indexer = sys.modules[Glm5NextTextModel.__module__].Glm5NextTextIndexer
    forward, topk = indexer.forward, torch.Tensor.topk

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    def pinned(self, *args, **kwargs):
        torch.Tensor.topk = stable_topk
        try:
            return forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = topk

    indexer.forward = pinned
    try:
        yield
    finally:
        indexer.forward = forward


def oracle_forward(model, ids: torch.Tensor, islands64: bool = True) -> torch.Tensor:
    """Logits [T, vocab] (or last hidden states for a bare text model) of one full, cache-free forward."""
    ctx = float64_islands() if islands64 else nullcontext()
    with torch.no_grad(), ctx, lowest_pool_wins_ties():
        out = model(input_ids=ids.reshape(1, -1), use_cache=False)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state)[0]


def oracle_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens by full recomputation: the oracle has no cache to share a cache's mistakes."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(int(oracle_forward(model, torch.tensor(seq))[-1].argmax()))
    return seq[len(prompt):]

