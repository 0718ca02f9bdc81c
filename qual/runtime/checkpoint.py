"""Hugging Face-format checkpoints: a Qwen3 target and a DFlash drafter (public format, vLLM's names)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qual.errors import QualError


@dataclass(frozen=True, slots=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_id: int | None


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    layers: Qwen3Config  # the draft layers' shapes
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]  # "full_attention" (non-causal block) | "sliding_attention" (causal, windowed)
    sliding_window: int | None


def _read_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise QualError(f"checkpoint directory not found: {path}")
    if not cfg_path.is_file():
        raise QualError(f"checkpoint {path} has no config.json")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise QualError(f"{cfg_path}: malformed JSON ({exc.msg} at line {exc.lineno})") from None


def _field(cfg: dict, key: str, where: Path, default=...):
    if key in cfg:
        return cfg[key]
    if default is ...:
        raise QualError(f"{where / 'config.json'}: missing field {key!r}")
    return default


def _qwen3_fields(cfg: dict, where: Path) -> Qwen3Config:
    heads = int(_field(cfg, "num_attention_heads", where))
    hidden = int(_field(cfg, "hidden_size", where))
    rope = cfg.get("rope_parameters") or {}
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return Qwen3Config(
        vocab_size=int(_field(cfg, "vocab_size", where)),
        hidden_size=hidden,
        num_hidden_layers=int(_field(cfg, "num_hidden_layers", where)),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(_field(cfg, "intermediate_size", where)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        eos_token_id=eos,
    )


def load_target_config(path: str | Path) -> Qwen3Config:
    path = Path(path)
    cfg = _read_config(path)
    if cfg.get("model_type") != "qwen3":
        raise QualError(f"{path / 'config.json'}: model_type must be 'qwen3' (got {cfg.get('model_type')!r})")
    return _qwen3_fields(cfg, path)


def load_draft_config(path: str | Path) -> DFlashConfig:
    path = Path(path)
    cfg = _read_config(path)
    if "DFlashDraftModel" not in (cfg.get("architectures") or []):
        raise QualError(f"{path / 'config.json'}: architectures must include 'DFlashDraftModel'")
    dflash = _field(cfg, "dflash_config", path)
    if not isinstance(dflash, dict):
        raise QualError(f"{path / 'config.json'}: dflash_config must be an object")
    layers = _qwen3_fields(cfg, path)
    layer_types = tuple(cfg.get("layer_types") or ["full_attention"] * layers.num_hidden_layers)
    if len(layer_types) != layers.num_hidden_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise QualError(f"{path / 'config.json'}: layer_types must list full_attention/sliding_attention for each of {layers.num_hidden_layers} layers")
    window = cfg.get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise QualError(f"{path / 'config.json'}: sliding_attention layers need sliding_window")
    num_target_layers = int(_field(cfg, "num_target_layers", path))
    ids = tuple(int(i) for i in _field(dflash, "target_layer_ids", path))
    if not ids or any(i < 0 or i > num_target_layers - 2 for i in ids):
        raise QualError(f"{path / 'config.json'}: target_layer_ids {list(ids)} must be within 0..{num_target_layers - 2}")
    mask = _field(dflash, "mask_token_id", path)
    if not isinstance(mask, int) or not 0 <= mask < layers.vocab_size:
        raise QualError(f"{path / 'config.json'}: mask_token_id {mask!r} is not a vocabulary id (vocab_size {layers.vocab_size})")
    return DFlashConfig(
        layers=layers,
        block_size=int(_field(cfg, "block_size", path)),
        num_target_layers=num_target_layers,
        mask_token_id=mask,
        target_layer_ids=ids,
        layer_types=layer_types,
        sliding_window=int(window) if window else None,
    )


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded with an index)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QualError(f"checkpoint {path} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises its own error types
            raise QualError(f"{f}: unreadable safetensors file ({exc})") from None
    return weights


def require(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], where: Path | str) -> torch.Tensor:
    """A named tensor with the expected shape, or a clear error."""
    if name not in weights:
        raise QualError(f"checkpoint {where}: missing tensor {name!r}")
    t = weights[name]
    if tuple(t.shape) != tuple(shape):
        raise QualError(f"checkpoint {where}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def save_checkpoint(path: str | Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    """Write config.json + model.safetensors (used by tests and the toy trainer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
