"""Tiny random checkpoints in the real on-disk formats (HF Qwen3 target, public DFlash drafter)."""

from __future__ import annotations

from pathlib import Path

import torch

from qual.runtime.checkpoint import save_checkpoint

TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, intermediate_size=128)


def _layer(prefix: str, H: int, hid: int, heads: int, kv: int, D: int, inter: int, g: torch.Generator, scale: float) -> dict:
    r = lambda *s: torch.randn(*s, generator=g) * scale  # noqa: E731
    ones = lambda n: 1.0 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    return {
        f"{prefix}self_attn.q_proj.weight": r(heads * D, hid),
        f"{prefix}self_attn.k_proj.weight": r(kv * D, hid),
        f"{prefix}self_attn.v_proj.weight": r(kv * D, hid),
        f"{prefix}self_attn.o_proj.weight": r(hid, heads * D),
        f"{prefix}self_attn.q_norm.weight": ones(D),
        f"{prefix}self_attn.k_norm.weight": ones(D),
        f"{prefix}mlp.gate_proj.weight": r(inter, hid),
        f"{prefix}mlp.up_proj.weight": r(inter, hid),
        f"{prefix}mlp.down_proj.weight": r(hid, inter),
        f"{prefix}input_layernorm.weight": ones(hid),
        f"{prefix}post_attention_layernorm.weight": ones(hid),
    }


def _qwen3_config(d: dict) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 1024, "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": d["vocab_size"] - 2, **d,
    }


def make_target(path: Path, seed: int = 0, scale: float = 0.15, **over) -> Path:
    """A random Qwen3 target with peaked logits (so greedy choices are not near ties)."""
    d = {**TINY, **over}
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(d["vocab_size"], d["hidden_size"], generator=g),
         "model.norm.weight": torch.ones(d["hidden_size"]),
         "lm_head.weight": torch.randn(d["vocab_size"], d["hidden_size"], generator=g)}
    for i in range(d["num_hidden_layers"]):
        w.update(_layer(f"model.layers.{i}.", 0, d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"],
                        d["head_dim"], d["intermediate_size"], g, scale))
    save_checkpoint(path, _qwen3_config(d), w)
    return path


def make_draft(path: Path, seed: int = 1, scale: float = 0.15, block_size: int = 4, target_layer_ids=(0, 2),
               layer_types=("full_attention", "full_attention"), sliding_window=None, **over) -> Path:
    """A random drafter in the public DFlash format."""
    d = {**TINY, **over, "num_hidden_layers": len(layer_types)}
    g = torch.Generator().manual_seed(seed)
    hid = d["hidden_size"]
    w = {"fc.weight": torch.randn(hid, hid * len(target_layer_ids), generator=g) * scale,
         "hidden_norm.weight": torch.ones(hid), "norm.weight": torch.ones(hid)}
    for i in range(d["num_hidden_layers"]):
        w.update(_layer(f"layers.{i}.", 0, hid, d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"],
                        d["intermediate_size"], g, scale))
    cfg = _qwen3_config(d) | {
        "architectures": ["DFlashDraftModel"], "block_size": block_size, "num_target_layers": TINY["num_hidden_layers"],
        "dflash_config": {"mask_token_id": d["vocab_size"] - 1, "target_layer_ids": list(target_layer_ids)},
        "layer_types": list(layer_types),
    }
    if sliding_window:
        cfg["sliding_window"] = sliding_window
    save_checkpoint(path, cfg, w)
    return path


def make_tokenizer(path: Path, vocab_size: int = TINY["vocab_size"]) -> Path:
    """A character-level tokenizer.json: ids 0..vocab-3 are characters, then EOS, then MASK (matches make_target)."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    chars = ["\n"] + [chr(c) for c in range(32, 32 + vocab_size - 3)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<|endoftext|>"] = vocab_size - 2
    vocab["<|mask|>"] = vocab_size - 1
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=" "))
    tok.add_special_tokens(["<|endoftext|>", "<|mask|>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def make_profile(root: Path, name: str = "tiny", **over) -> Path:
    """A model profile YAML pointing at fresh tiny checkpoints (for harness tests)."""
    import yaml

    target = make_target(root / "target")
    make_tokenizer(target)
    draft = make_draft(root / "draft")
    profile = {"name": name, "target": str(target), "draft": str(draft), "num_speculative_tokens": 3, "block_size": 4,
               "kv_memory_mib": 4, "dtype": "float64", "corpus": "smoke", "max_tokens": 12, **over}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path
