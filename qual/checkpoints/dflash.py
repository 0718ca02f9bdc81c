"""The public DFlash drafter format (what vLLM's DFlash loader reads): config fields and weight names.

See docs/dflash.md. Weights carry no `model.` prefix: fc, hidden_norm, norm, layers.i.*; the embedding and
LM head are the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qual.checkpoints.io import field, read_config, save_checkpoint
from qual.checkpoints.qwen3 import Qwen3Config, random_layer
from qual.errors import QualError

ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")  # full: non-causal block; sliding: causal, windowed


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    """A DFlash drafter's config.json."""

    layers: Qwen3Config  # the draft layers' shapes
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None

    @classmethod
    def from_json(cls, cfg: dict, path: Path) -> "DFlashConfig":
        where = path / "config.json"
        if ARCHITECTURE not in (cfg.get("architectures") or []):
            raise QualError(f"{where}: architectures must include {ARCHITECTURE!r}")
        dflash = field(cfg, "dflash_config", path)
        if not isinstance(dflash, dict):
            raise QualError(f"{where}: dflash_config must be an object")
        layers = Qwen3Config.from_json(cfg, path)
        layer_types = tuple(cfg.get("layer_types") or ["full_attention"] * layers.num_hidden_layers)
        if len(layer_types) != layers.num_hidden_layers or set(layer_types) - set(LAYER_TYPES):
            raise QualError(f"{where}: layer_types must list full_attention/sliding_attention for each of "
                            f"{layers.num_hidden_layers} layers")
        window = cfg.get("sliding_window")
        if "sliding_attention" in layer_types and not window:
            raise QualError(f"{where}: sliding_attention layers need sliding_window")
        num_target_layers = int(field(cfg, "num_target_layers", path))
        ids = tuple(int(i) for i in field(dflash, "target_layer_ids", path))
        if not ids or any(i < 0 or i > num_target_layers - 2 for i in ids):
            raise QualError(f"{where}: target_layer_ids {list(ids)} must be within 0..{num_target_layers - 2}")
        mask = field(dflash, "mask_token_id", path)
        if not isinstance(mask, int) or not 0 <= mask < layers.vocab_size:
            raise QualError(f"{where}: mask_token_id {mask!r} is not a vocabulary id (vocab_size {layers.vocab_size})")
        block_size = field(cfg, "block_size", path)
        if not isinstance(block_size, int) or block_size < 2:
            raise QualError(f"{where}: block_size must be an integer >= 2 (the last token plus at least one draft), "
                            f"got {block_size!r}")
        return cls(layers, block_size, num_target_layers, mask, ids, layer_types, int(window) if window else None)

    def to_json(self) -> dict:
        """config.json in the public format."""
        out = {
            **self.layers.to_json(),
            "architectures": [ARCHITECTURE],
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "layer_types": list(self.layer_types),
        }
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        return out


def read_dflash(path: str | Path) -> DFlashConfig:
    path = Path(path)
    return DFlashConfig.from_json(read_config(path), path)


def random_draft_weights(cfg: DFlashConfig, seed: int = 1, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """A random drafter: fc N(0, scale^2), norms 1, layers as qwen3.random_layer."""
    g = torch.Generator().manual_seed(seed)
    hid = cfg.layers.hidden_size
    w = {"fc.weight": torch.randn(hid, hid * len(cfg.target_layer_ids), generator=g) * scale,
         "hidden_norm.weight": torch.ones(hid), "norm.weight": torch.ones(hid)}
    for i in range(cfg.layers.num_hidden_layers):
        w.update(random_layer(cfg.layers, f"layers.{i}.", g, scale))
    return w


def write_dflash(path: str | Path, cfg: DFlashConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                 **config_overrides) -> Path:
    """A drafter checkpoint directory (weights cast to dtype when given)."""
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
        config_overrides.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    return save_checkpoint(path, {**cfg.to_json(), **config_overrides}, weights)
