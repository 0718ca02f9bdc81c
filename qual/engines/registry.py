"""Engines by name: the one place that knows which engines exist (adding one is a module plus a line here)."""

from __future__ import annotations

import importlib

from qual.engines.base import Engine
from qual.errors import QualError

# name -> "module:Class"; imported on first use (the vLLM adapter and the runtime are not loaded for nothing).
ENGINES = {
    "reference": "qual.engines.reference:ReferenceEngine",
    "vllm": "qual.engines.vllm.engine:VllmEngine",
    "attach": "qual.engines.vllm.attach:AttachEngine",  # vLLM servers qual did not start (--control-url ...)
}


def engine_class(name: str) -> type[Engine]:
    """The Engine subclass registered under name (QualError naming the known ones)."""
    if name not in ENGINES:
        raise QualError(f"--engine must be one of {', '.join(ENGINES)} (got {name!r})")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_engine(name: str, inventory=None) -> Engine:
    """A fresh engine instance, asking `inventory` (qual.inventory.Inventory; default: this machine) what the machine
    has."""
    return engine_class(name)(inventory=inventory)
