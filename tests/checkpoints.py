"""Tiny random checkpoints for tests, written by the format module (qual.checkpoints)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qual.checkpoints.dflash import DFlashConfig, random_draft_weights, write_dflash
from qual.checkpoints.qwen3 import Qwen3Config, random_target_weights, write_qwen3

TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, intermediate_size=128)


def tiny_config(**over) -> Qwen3Config:
    """TINY with overrides; EOS is vocab_size - 2 (the tokenizer's), MASK vocab_size - 1."""
    d = {**TINY, **over}
    return Qwen3Config(**d, max_position_embeddings=1024, eos_token_id=d["vocab_size"] - 2)


def make_target(path: Path, seed: int = 0, scale: float = 0.15, live_tokens: int | None = None, **over) -> Path:
    """A random Qwen3 target with peaked logits (so greedy choices are not near ties).

    live_tokens: the LM head's first rows grow 6x and the others shrink 5x, so the target keeps choosing among those
    few tokens and a drafter (which reads the same LM head) often guesses right: steps accept, and commit several
    tokens, without making the drafter's own computation irrelevant."""
    cfg = tiny_config(**over)
    w = random_target_weights(cfg, seed, scale)
    if live_tokens:
        w["lm_head.weight"][:live_tokens] *= 6.0
        w["lm_head.weight"][live_tokens:] *= 0.2
    return write_qwen3(path, cfg, w)


def make_draft(path: Path, seed: int = 1, scale: float = 0.15, block_size: int = 4, target_layer_ids=(0, 2),
               layer_types=("full_attention", "full_attention"), sliding_window=None, options: dict | None = None,
               attention_bias: bool = False, num_target_layers: int = TINY["num_hidden_layers"], **over) -> Path:
    """A random drafter in the public DFlash format (options: further DFlashConfig fields, e.g. dflash2=...)."""
    layers = replace(tiny_config(**{**over, "num_hidden_layers": len(layer_types)}), attention_bias=attention_bias)
    cfg = DFlashConfig(layers, block_size, num_target_layers, layers.vocab_size - 1, tuple(target_layer_ids),
                       tuple(layer_types), sliding_window, **(options or {}))
    return write_dflash(path, cfg, random_draft_weights(cfg, seed, scale))


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
    reference = {"block_size": 4, "kv_memory_mib": 4, **over.pop("reference", {})}
    profile = {"name": name, "target": str(target), "draft": str(draft), "num_speculative_tokens": 3,
               "dtype": "float64", "corpus": "smoke", "max_tokens": 12, "reference": reference, **over}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path
