"""Bytes one GPU of an arm holds for its target: the one call an engine makes for a memory plan (Engine.memory_need),
over the runtime's own sizing code. GLM-5 targets have a plan (qual/runtime/models/glm5/sizing.py: the loader over
meta-device shapes, the cache manager's reservation per request); other architectures have none yet (None)."""

from __future__ import annotations

from dataclasses import dataclass

from qual.runtime.models.glm5.config import parse_glm5_config

PLANNED = ("glm5_next_text", "glm5_next")  # config.json model_types with a memory plan


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes: its weights and its caches (every rank of the arm holds the same amounts)."""

    weights: int
    caches: int

    @property
    def total(self) -> int:
        return self.weights + self.caches


def rank_memory(config: dict, where: str, *, tp: int, dcp: int, dtype: str, num_speculative_tokens: int,
                context: int, sequences: int, block_size: int) -> RankMemory | None:
    """A rank's weights (FP8 experts where config.json quantizes them) and caches for `sequences` requests of
    `context` tokens at TP / DCP; None for an architecture without a plan."""
    if config.get("model_type") not in PLANNED:
        return None
    import torch

    from qual.runtime.models.glm5.sizing import cache_bytes, weight_bytes

    cfg = parse_glm5_config(config, where)
    torch_dtype = getattr(torch, dtype)
    weights = weight_bytes(cfg, tp, torch_dtype)["total"]
    caches = cache_bytes(cfg, tp, dcp, torch_dtype, num_speculative_tokens, context, sequences, block_size)["total"]
    return RankMemory(weights, caches)
