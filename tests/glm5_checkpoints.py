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



# -- vLLM's forms of the real checkpoint, which transformers cannot build: a float64 recomputation from their
# definitions (vLLM's glm5next), made of transformers' modules with the parts those forms change replaced ------------

def rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """RoPE over the last dim R of x [B, S, R] or [B, S, H, R] at positions [S], as vLLM defines it: float32
    frequencies theta^(-2i/R) and angles, cos/sin cast to x's dtype; pairs (2i, 2i+1) or halves (i, i + R/2)."""
    R = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float32) / R)
    angles = positions.float()[:, None] * inv_freq  # [S, R/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if x.dim() == 4:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : R // 2], x[..., R // 2:])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.stack([o1, o2], -1).flatten(-2) if interleaved else torch.cat([o1, o2], -1)


class _RotateFirst(torch.nn.Module):
    """A projection (wq_b: heads of Di) or the key norm, followed by RoPE on the first R dims of each head."""

    def __init__(self, inner: torch.nn.Module, R: int, head_dim: int, theta: float, interleaved: bool):
        super().__init__()
        self.inner, self.R, self.head_dim, self.theta, self.interleaved = inner, R, head_dim, theta, interleaved

    def forward(self, x):
        y = self.inner(x)
        B, S = y.shape[:2]
        heads = y.view(B, S, -1, self.head_dim)
        rot = rope_reference(heads[..., : self.R], torch.arange(S), self.theta, self.interleaved)
        return torch.cat([rot, heads[..., self.R:]], -1).view_as(y)


def _mla_forward(form: dict):
    """Glm5NextTextAttention.forward with vLLM's MLA: q = [nope | rope] per head, k_pe the last R rows of kv_a
    (not normed), both rotated as interleaved pairs when MLA RoPE is on, k_pe zero under mla_use_nope; scale
    (nope + rope)^-0.5; sparse selection from transformers' own indexer. Full sequences from position 0."""

    def forward(self, hidden_states, attention_mask, cache=None, prev_topk_indices=None, **kwargs):
        B, S, _ = hidden_states.shape
        P, R, L, H, V = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank, self.num_heads, self.v_head_dim
        pos = torch.arange(S)
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_resid).view(B, S, H, P + R)
        kv = self.kv_a_proj_with_mqa(hidden_states)
        latent, k_pe = self.kv_a_layernorm(kv[..., :L]), kv[..., L:]
        q_nope, q_pe = q[..., :P], q[..., P:]
        if form["mla_rope"]:
            q_pe = rope_reference(q_pe, pos, form["theta"], interleaved=True)
            k_pe = rope_reference(k_pe, pos, form["theta"], interleaved=True)
        else:
            k_pe = torch.zeros_like(k_pe)  # vLLM pads kv_a with zero rope rows under mla_use_nope
        k_nope, v = self.kv_b_proj(latent).view(B, S, H, P + V).split([P, V], -1)
        scores = (torch.einsum("bqhd,bkhd->bhqk", q_nope, k_nope)
                  + torch.einsum("bqhd,bkd->bhqk", q_pe, k_pe)) * self.scaling
        if self.indexer is not None:
            topk = self.indexer(hidden_states=hidden_states, q_resid=q_resid, attention_mask=attention_mask, cache=None)
        else:
            topk = prev_topk_indices
        mask = self.build_attention_mask_from_topk(topk_indices=topk, query_states=scores, kv_length=S)
        probs = torch.softmax(scores + mask, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, H * V)
        return self.o_proj(out), None, topk if self.next_skip_topk else None

    return forward


def _plain_residual(self, streams):
    """Glm5NextTextHyperConnection with one stream reduced to a plain residual: the block reads the stream, and its
    output is added to it (post 1, comb 1): vLLM's mhc false."""
    ones = streams.new_ones(streams.shape[:-1])
    return ones, ones[..., None], streams[..., 0, :]


@contextmanager
def vllm_forms(form: dict):
    """transformers' classes computing the form (mhc, MLA RoPE, indexer RoPE) while the context is open."""
    mod = sys.modules[Glm5NextTextModel.__module__]
    saved = mod.Glm5NextTextAttention.forward, mod.Glm5NextTextHyperConnection.forward
    mod.Glm5NextTextAttention.forward = _mla_forward(form)
    if not form["mhc"]:
        mod.Glm5NextTextHyperConnection.forward = _plain_residual
    try:
        yield
    finally:
        mod.Glm5NextTextAttention.forward, mod.Glm5NextTextHyperConnection.forward = saved


def make_glm5_form(path: Path, text: dict, form: dict, seed: int = 0):
    """A random composite model in one of vLLM's forms, saved as that form's checkpoint (config keys mhc,
    mla_use_nope, indexer_rope_interleave, rope_theta; no hc_* tensors without mhc; kv_a's latent rows only under
    mla_use_nope), and the float64 model that recomputes it (use it inside vllm_forms(form))."""
    import json

    from safetensors.torch import load_file, save_file

    R = form["rope_dim"]
    config = Glm5NextConfig(text_config={**text, "hc_mult": text.get("hc_mult", 4) if form["mhc"] else 1},
                            vision_config=TINY_VISION)
    object.__setattr__(config.text_config, "qk_rope_head_dim", R)  # transformers' config refuses R > 0
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(config)
    _randomize(model, seed)
    model.save_pretrained(str(path))
    model = model.to(torch.float64).eval()
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    for layer in model.model.language_model.layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None and R:
            indexer.wq_b = _RotateFirst(indexer.wq_b, R, indexer.head_dim, form["theta"], form["interleave"])
            indexer.k_norm = _RotateFirst(indexer.k_norm, R, indexer.head_dim, form["theta"], form["interleave"])
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"].update(mhc=form["mhc"], rope_theta=form["theta"])
    if R:
        raw["text_config"].update(mla_use_nope=not form["mla_rope"], indexer_rope_interleave=form["interleave"])
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    weights = load_file(str(path / "model.safetensors"))
    L = text["kv_lora_rank"]
    for name in list(weights):
        if not form["mhc"] and ".hc_" in name:
            del weights[name]
        elif R and not form["mla_rope"] and name.endswith("kv_a_proj_with_mqa.weight"):
            weights[name] = weights[name][:L].contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, model
