"""A tiny rigged Qwen3 target + DFlash drafter for vLLM smoke tests, written by qual.checkpoints (docs/vllm.md).

For smoke-testing a vLLM install end to end in seconds. Weights are random, but rigged so
that acceptance is neither zero nor total: the target's LM head gives real logits to a
few "live" tokens only (so it tends to repeat them), and the drafter's residual branches
are zero, so it always proposes the token whose LM-head row the mask embedding points at.
Acceptance then depends on how long the target keeps repeating that token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from qual.checkpoints.dflash import DFlashConfig, write_dflash
from qual.checkpoints.qwen3 import Qwen3Config, write_qwen3


@dataclass(frozen=True)
class TinyShape:
    """Sizes of the tiny pair."""

    vocab_size: int = 96
    hidden_size: int = 64
    intermediate_size: int = 128
    num_target_layers: int = 4
    num_draft_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 8  # DFlash block: the last token + K = block_size - 1 drafts
    live_tokens: int = 4  # tokens with a non-zero LM-head row
    draft_token_id: int = 1  # the token the drafter proposes (one of the live tokens)
    sliding_window: int = 16
    max_position_embeddings: int = 2048

    @property
    def eos_token_id(self) -> int:
        return self.vocab_size - 1

    @property
    def mask_token_id(self) -> int:
        return self.vocab_size - 2


def _tokenizer_json(shape: TinyShape) -> dict:
    vocab = {f"t{i}": i for i in range(shape.vocab_size)}
    vocab["<mask>"] = shape.mask_token_id
    vocab["</s>"] = shape.eos_token_id
    del vocab[f"t{shape.mask_token_id}"], vocab[f"t{shape.eos_token_id}"]
    specials = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for tok, i in (("<mask>", shape.mask_token_id), ("</s>", shape.eos_token_id))
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    }


def _qwen3(shape: TinyShape, num_layers: int) -> Qwen3Config:
    return Qwen3Config(shape.vocab_size, shape.hidden_size, num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                       shape.intermediate_size, max_position_embeddings=shape.max_position_embeddings,
                       eos_token_id=shape.eos_token_id)


def _layer_weights(prefix: str, shape: TinyShape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, q, kv, d = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.head_dim

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * (1.0 / size[-1] ** 0.5)

    return {
        f"{prefix}.self_attn.q_proj.weight": rand(q, h),
        f"{prefix}.self_attn.k_proj.weight": rand(kv, h),
        f"{prefix}.self_attn.v_proj.weight": rand(kv, h),
        f"{prefix}.self_attn.o_proj.weight": rand(h, q),
        f"{prefix}.self_attn.q_norm.weight": torch.ones(d),
        f"{prefix}.self_attn.k_norm.weight": torch.ones(d),
        f"{prefix}.mlp.gate_proj.weight": rand(shape.intermediate_size, h),
        f"{prefix}.mlp.up_proj.weight": rand(shape.intermediate_size, h),
        f"{prefix}.mlp.down_proj.weight": rand(h, shape.intermediate_size),
        f"{prefix}.input_layernorm.weight": torch.ones(h),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
    }


def build_tiny_pair(out_dir: Path, shape: TinyShape = TinyShape(), seed: int = 0,
                    mixed_draft_layers: bool = False) -> tuple[Path, Path]:
    """Write <out_dir>/target and <out_dir>/draft; returns their paths."""
    gen = torch.Generator().manual_seed(seed)
    target, draft = Path(out_dir) / "target", Path(out_dir) / "draft"
    target.mkdir(parents=True, exist_ok=True)
    draft.mkdir(parents=True, exist_ok=True)
    h = shape.hidden_size

    weights = {"model.embed_tokens.weight": torch.randn(shape.vocab_size, h, generator=gen)}
    for i in range(shape.num_target_layers):
        weights.update(_layer_weights(f"model.layers.{i}", shape, gen))
    weights["model.norm.weight"] = torch.ones(h)
    lm_head = torch.zeros(shape.vocab_size, h)
    lm_head[: shape.live_tokens] = torch.randn(shape.live_tokens, h, generator=gen)
    weights["lm_head.weight"] = lm_head
    # The drafter's hidden state at a mask slot is the mask embedding itself (see below).
    weights["model.embed_tokens.weight"][shape.mask_token_id] = lm_head[shape.draft_token_id] * 4.0
    write_qwen3(target, _qwen3(shape, shape.num_target_layers), weights)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": shape.eos_token_id}))
    for path in (target, draft):
        (path / "tokenizer.json").write_text(json.dumps(_tokenizer_json(shape)))
        (path / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "pad_token": "</s>",
            "model_max_length": shape.max_position_embeddings,
        }))

    target_layer_ids = [0, shape.num_target_layers - 2]
    dweights = {
        "fc.weight": torch.randn(h, h * len(target_layer_ids), generator=gen) / (h * len(target_layer_ids)) ** 0.5,
        "hidden_norm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
    }
    for i in range(shape.num_draft_layers):
        layer = _layer_weights(f"layers.{i}", shape, gen)
        # Zero residual branches: drafts are a constant token, a deterministic partial match.
        layer[f"layers.{i}.self_attn.o_proj.weight"].zero_()
        layer[f"layers.{i}.mlp.down_proj.weight"].zero_()
        dweights.update(layer)
    layer_types = ["full_attention"] * shape.num_draft_layers
    if mixed_draft_layers:  # DFlash2-style: sliding (causal, windowed) layers before full ones
        layer_types[0] = "sliding_attention"
    dconfig = DFlashConfig(_qwen3(shape, shape.num_draft_layers), shape.block_size, shape.num_target_layers,
                           shape.mask_token_id, tuple(target_layer_ids), tuple(layer_types), shape.sliding_window)
    write_dflash(draft, dconfig, dweights)
    return target, draft
