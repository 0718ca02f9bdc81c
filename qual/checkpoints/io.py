"""Checkpoint tensors: safetensors files read and written, with errors that name the file (their config.json:
qual/checkpoints/config.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qual.errors import QualError
from qual.files import save_safetensors, write_text
from qual.userfiles import load_safetensors


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QualError(f"checkpoint {path} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:  # a FIFO or device named *.safetensors is refused, never waited on
        for name, tensor in load_safetensors(f).items():
            if tensor.is_floating_point() and tensor.element_size() > 1 and not torch.isfinite(tensor).all():
                # a NaN or an infinity in a weight runs as a model whose outputs mean nothing (float8 is read by
                # the loaders that dequantize it)
                raise QualError(f"{f}: tensor {name!r} holds NaN or infinite values; refused")
            weights[name] = tensor
    return weights


def require(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], where: Path | str) -> torch.Tensor:
    """A named tensor with the expected shape, or a clear error."""
    if name not in weights:
        raise QualError(f"checkpoint {where}: missing tensor {name!r}")
    t = weights[name]
    if tuple(t.shape) != tuple(shape):
        raise QualError(f"checkpoint {where}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def save_checkpoint(path: str | Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    """Write config.json + model.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_text(path / "config.json", json.dumps(config, indent=2) + "\n")
    save_safetensors(path / "model.safetensors", weights)
    return path
