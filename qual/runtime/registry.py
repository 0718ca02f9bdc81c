"""Models by checkpoint: targets by config.json `model_type`, drafters by `architectures`.

Adding an architecture is one module implementing qual/runtime/models/base.py plus one line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from qual.checkpoints.config import read_config
from qual.errors import QualError

TARGETS = {
    "qwen3": "qual.runtime.models.qwen3:Qwen3Target",
    "glm5_next_text": "qual.runtime.models.glm5.target:Glm5Target",
    "glm5_next": "qual.runtime.models.glm5.target:Glm5Target",  # the multimodal form: its text stack only
}
DRAFTERS = {
    "DFlashDraftModel": "qual.runtime.models.dflash:DFlashDrafter",
    "DFlash2DraftModel": "qual.runtime.models.dflash:DFlash2Drafter",
}


def _load(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint's validated config and the class that runs it: read once on the driver, passed to every rank."""

    path: str
    config: Any
    ref: str  # "module:Class" from the registry

    @cached_property
    def model_class(self):
        return _load(self.ref)


def target_spec(path: str | Path) -> ModelSpec:
    """The target checkpoint at path (its model_type picks the class)."""
    raw = read_config(path)
    model_type = raw.get("model_type")
    if model_type not in TARGETS:
        raise QualError(f"{Path(path) / 'config.json'}: model_type {model_type!r} is not a supported target "
                        f"(supported: {', '.join(TARGETS)})")
    ref = TARGETS[model_type]
    return ModelSpec(str(path), _load(ref).parse_config(raw, Path(path)), ref)


def draft_spec(path: str | Path) -> ModelSpec:
    """The drafter checkpoint at path (its architectures pick the class)."""
    raw = read_config(path)
    archs = [a for a in raw.get("architectures") or [] if a in DRAFTERS]
    if not archs:
        raise QualError(f"{Path(path) / 'config.json'}: architectures {raw.get('architectures')!r} name no supported "
                        f"drafter (supported: {', '.join(DRAFTERS)})")
    ref = DRAFTERS[archs[0]]
    return ModelSpec(str(path), _load(ref).parse_config(raw, Path(path)), ref)


def validate(cfg, devices: bool = True) -> tuple[ModelSpec, ModelSpec | None]:
    """Read both checkpoints' configs (once) and check every constraint of an EngineConfig before any process starts;
    devices=False leaves out whether this machine has the GPUs it names (a dry run's plan for another machine)."""
    target = target_spec(cfg.target_path)
    target.model_class.check_parallel(target.config, cfg.parallel)
    draft = None
    if cfg.draft_path:
        draft = draft_spec(cfg.draft_path)
        draft.model_class.check_parallel(draft.config, cfg.parallel)
        draft.model_class.check_target(draft.config, target.config, cfg.draft_path)
        block = draft.config.block_size
        if cfg.num_speculative_tokens is not None and cfg.num_speculative_tokens > block - 1:
            raise QualError(f"num_speculative_tokens={cfg.num_speculative_tokens} exceeds what the drafter's block "
                            f"allows (block_size {block}: the last token plus at most {block - 1} drafts)")
    if devices and cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise QualError("device cuda requested but CUDA is not available")
        if torch.cuda.device_count() < cfg.parallel.world_size:
            raise QualError(f"tp={cfg.parallel.world_size} needs {cfg.parallel.world_size} GPUs; "
                            f"{torch.cuda.device_count()} visible")
    return target, draft
