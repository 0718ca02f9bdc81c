"""The Hugging Face Qwen3 checkpoint format: config fields, weight names, and random checkpoints for tests."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from qual.checkpoints.config import field, read_config, true_or_false
from qual.checkpoints.io import save_checkpoint
from qual.errors import QualError
from qual.validation import shown

MODEL_TYPE = "qwen3"


# What transformers' Qwen3Config (5.x) fills in for an absent key. vLLM builds that config for every qwen3 checkpoint,
# a target's or a DFlash drafter's, so an absent key means these values there, and so here.
TRANSFORMERS_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 32, "rms_norm_eps": 1e-6,
                         "max_position_embeddings": 32768, "rope_theta": 10000.0}


# Every key of a Qwen3 target's config.json: read (the fields of Qwen3Config), checked to hold what the runtime
# implements, or known to change nothing a forward pass computes. Any other key is refused by name, as a drafter's
# are (qual/checkpoints/dflash.py); tests/test_hostile_boundary.py checks every key transformers' Qwen3Config writes
# is here or in TARGET_REFUSED.
TARGET_KEYS = {
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "rope_parameters",
    "rope_scaling", "tie_word_embeddings", "max_position_embeddings", "eos_token_id", "attention_bias",
    "hidden_act",  # silu only
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",  # full attention only
    # bookkeeping and training-time keys
    "bos_token_id", "pad_token_id", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
    "initializer_range", "use_cache", "attention_dropout", "output_attentions", "output_hidden_states",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
}
TARGET_REFUSED = {
    "quantization_config": "a quantized Qwen3 target is not supported: its weights are read as stored (FP8 block "
                           "scales are dequantized for GLM-5 targets only); give an unquantized checkpoint",
}


def _fail(where: Path, key: str, value: Any, expected: str) -> QualError:
    return QualError(f"{Path(where) / 'config.json'}: {key}: expected {expected}, got {shown(value)}")


def _positive_int(cfg: dict, key: str, where: Path, default: Any = ...) -> int:
    value = field(cfg, key, where, default)
    if type(value) is not int or value <= 0:  # no bool, no "256", no 256.7: read as written, never coerced
        raise _fail(where, key, value, "a positive integer")
    return value


def _positive_float(value: Any, key: str, where: Path) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise _fail(where, key, value, "a positive number")
    return float(value)


def _bool(cfg: dict, key: str, where: Path, default: bool) -> bool:
    return true_or_false(cfg.get(key, default), key, Path(where) / "config.json")  # null too: transformers refuses it


def check_target_keys(cfg: dict, where: Path) -> None:
    """A Qwen3 target's config.json holds only keys the runtime reads or knows change nothing, and what it checks
    holds what the runtime implements (QualError naming the key)."""
    at = Path(where) / "config.json"
    for key, value in cfg.items():
        if key in TARGET_REFUSED and value not in (None, False, {}, []):
            raise QualError(f"{at}: {key}: {TARGET_REFUSED[key]}")
        if key not in TARGET_KEYS and key not in TARGET_REFUSED:
            raise QualError(f"{at}: unknown key {key} (a Qwen3 target key this runtime does not implement)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise QualError(f"{at}: hidden_act {shown(cfg['hidden_act'])} is not supported (silu only)")
    if _bool(cfg, "use_sliding_window", where, False):
        raise QualError(f"{at}: use_sliding_window true is not supported for a Qwen3 target (full attention only)")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or set(layer_types) - {"full_attention"}):
        raise QualError(f"{at}: layer_types must list full_attention only for a Qwen3 target (got "
                        f"{shown(layer_types)})")
    if _bool(cfg, "is_encoder_decoder", where, False):
        raise QualError(f"{at}: is_encoder_decoder true is not a decoder-only target")


def rope_parameters(cfg: dict, where: Path) -> dict:
    """The RoPE parameters a qwen3 config.json resolves to, by transformers' precedence: a legacy rope_scaling
    replaces rope_parameters; rope_parameters' rope_theta wins over the top-level rope_theta; 10000 when neither."""
    scaling = cfg.get("rope_scaling")
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise _fail(where, key, cfg[key], "an object")
    base = dict(scaling) if scaling else dict(cfg.get("rope_parameters") or {})
    base.setdefault("rope_type", base.pop("type", "default"))
    base.setdefault("rope_theta", cfg.get("rope_theta", TRANSFORMERS_DEFAULTS["rope_theta"]))
    return base


def default_rope_theta(cfg: dict, where: Path) -> float:
    """rope_theta of a config whose RoPE must be the "default" type; any other type (or a partial rotary factor) is
    refused by name: the runtime implements plain RoPE only."""
    rope = rope_parameters(cfg, where)
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    if rope["rope_type"] != "default":
        raise QualError(f"{Path(where) / 'config.json'}: {key}.rope_type {shown(rope['rope_type'])} is not supported "
                        f"(the runtime implements the default RoPE only)")
    if _positive_float(rope.get("partial_rotary_factor", 1.0), f"{key}.partial_rotary_factor", where) != 1.0:
        raise QualError(f"{Path(where) / 'config.json'}: {key}.partial_rotary_factor "
                        f"{rope['partial_rotary_factor']!r} is not supported (the runtime rotates whole heads)")
    theta_key = f"{key}.rope_theta" if "rope_theta" in (cfg.get(key) or {}) else "rope_theta"
    return _positive_float(rope["rope_theta"], theta_key, where)


@dataclass(frozen=True, slots=True)
class Qwen3Config:
    """What the runtime needs of a Qwen3 config.json (the target's, or a DFlash drafter's layers)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_id: int | None = None
    attention_bias: bool = False  # q/k/v/o projections carry biases

    @classmethod
    def from_json(cls, cfg: dict, where: Path) -> "Qwen3Config":
        """Absent keys take transformers' Qwen3Config defaults (what vLLM reads), not values guessed from others.
        Every value is read as its JSON type says, never coerced: "256", 256.7 or "false" is refused, naming the
        key (QualError, exit 2)."""
        heads = _positive_int(cfg, "num_attention_heads", where)
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None and (type(eos) is not int or eos < 0):
            raise _fail(where, "eos_token_id", cfg.get("eos_token_id"), "a token id, a list of them, or null")
        d = TRANSFORMERS_DEFAULTS
        kv = cfg.get("num_key_value_heads", d["num_key_value_heads"])  # an explicit null means "as many as heads"
        return cls(
            vocab_size=_positive_int(cfg, "vocab_size", where),
            hidden_size=_positive_int(cfg, "hidden_size", where),
            num_hidden_layers=_positive_int(cfg, "num_hidden_layers", where),
            num_attention_heads=heads,
            num_key_value_heads=heads if kv is None else _positive_int(cfg, "num_key_value_heads", where,
                                                                         d["num_key_value_heads"]),
            head_dim=_positive_int(cfg, "head_dim", where, d["head_dim"]),
            intermediate_size=_positive_int(cfg, "intermediate_size", where),
            rms_norm_eps=_positive_float(cfg.get("rms_norm_eps", d["rms_norm_eps"]), "rms_norm_eps", where),
            rope_theta=default_rope_theta(cfg, where),
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings", where, False),
            max_position_embeddings=_positive_int(cfg, "max_position_embeddings", where,
                                                  d["max_position_embeddings"]),
            eos_token_id=eos,
            attention_bias=_bool(cfg, "attention_bias", where, False),
        )

    def to_json(self) -> dict:
        """config.json fields in the Hugging Face format (transformers and vLLM read these)."""
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": MODEL_TYPE, "hidden_act": "silu",
            "attention_bias": self.attention_bias, "torch_dtype": "float32",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.eos_token_id, "eos_token_id": self.eos_token_id,
        }


def read_qwen3(path: str | Path) -> Qwen3Config:
    """A Qwen3 target's config (model_type must say qwen3)."""
    path = Path(path)
    cfg = read_config(path)
    if cfg.get("model_type") != MODEL_TYPE:
        raise QualError(f"{path / 'config.json'}: model_type must be {MODEL_TYPE!r} (got {cfg.get('model_type')!r})")
    check_target_keys(cfg, path)
    return Qwen3Config.from_json(cfg, path)


def layer_weight_shapes(cfg: Qwen3Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of one decoder layer, by its checkpoint name."""
    H, D, hid, kv, inter = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size, cfg.num_key_value_heads, cfg.intermediate_size
    return {
        f"{prefix}self_attn.q_proj.weight": (H * D, hid),
        f"{prefix}self_attn.k_proj.weight": (kv * D, hid),
        f"{prefix}self_attn.v_proj.weight": (kv * D, hid),
        f"{prefix}self_attn.o_proj.weight": (hid, H * D),
        f"{prefix}self_attn.q_norm.weight": (D,),
        f"{prefix}self_attn.k_norm.weight": (D,),
        f"{prefix}mlp.gate_proj.weight": (inter, hid),
        f"{prefix}mlp.up_proj.weight": (inter, hid),
        f"{prefix}mlp.down_proj.weight": (hid, inter),
        f"{prefix}input_layernorm.weight": (hid,),
        f"{prefix}post_attention_layernorm.weight": (hid,),
    }


def random_layer(cfg: Qwen3Config, prefix: str, g: torch.Generator, scale: float) -> dict[str, torch.Tensor]:
    """One decoder layer of random weights: matrices N(0, scale^2), norm weights near 1."""
    out = {}
    for name, shape in layer_weight_shapes(cfg, prefix).items():
        out[name] = (1.0 + 0.1 * torch.randn(shape, generator=g)) if len(shape) == 1 else torch.randn(shape, generator=g) * scale
    return out


def random_target_weights(cfg: Qwen3Config, seed: int = 0, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """A whole random target (untied LM head unless the config ties it)."""
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
         "model.norm.weight": torch.ones(cfg.hidden_size)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    for i in range(cfg.num_hidden_layers):
        w.update(random_layer(cfg, f"model.layers.{i}.", g, scale))
    return w


def write_qwen3(path: str | Path, cfg: Qwen3Config, weights: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                **config_overrides) -> Path:
    """A Qwen3 checkpoint directory (weights cast to dtype when given)."""
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
        config_overrides.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    return save_checkpoint(path, {**cfg.to_json(), **config_overrides}, weights)


def write_random_qwen3(path: str | Path, cfg: Qwen3Config, seed: int = 0, scale: float = 0.15,
                       dtype: torch.dtype | None = None) -> Path:
    """A random Qwen3 target in the real on-disk format."""
    return write_qwen3(path, cfg, random_target_weights(cfg, seed, scale), dtype)


__all__ = ["MODEL_TYPE", "TRANSFORMERS_DEFAULTS", "TARGET_KEYS", "TARGET_REFUSED", "Qwen3Config", "check_target_keys",
           "default_rope_theta", "rope_parameters", "read_qwen3", "layer_weight_shapes", "random_layer", "random_target_weights",
           "write_qwen3", "write_random_qwen3", "replace"]
