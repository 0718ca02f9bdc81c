"""Bytes one GPU of an arm holds for its target: the one call an engine makes for a memory plan (Engine.memory_need).
GLM-5 targets have two (qual/runtime/models/glm5/memory.py): as the embedded runtime allocates (its own sizing code:
the loader over meta-device shapes, the cache manager's reservation per request) and as vLLM 0.32 allocates;
other architectures have none yet (None)."""

from __future__ import annotations

from dataclasses import dataclass

from qual.runtime.models.glm5.config import parse_glm5_config

PLANNED = ("glm5_next_text", "glm5_next")  # config.json model_types with a memory plan


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes: its weights and its caches (every rank of the arm holds the same amounts), and each by part
    (weights by part, then caches by group, as glm5.memory.MemoryPlan names them)."""

    weights: int
    caches: int
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        return self.weights + self.caches


def rank_memory(config: dict, where: str, *, tp: int, dcp: int, dtype: str, num_speculative_tokens: int,
                context: int, sequences: int, block_size: int, plan: str = "qual") -> RankMemory | None:
    """A rank's weights (FP8 where config.json quantizes them) and caches for `sequences` requests of `context` tokens
    at TP / DCP, as `plan` ("qual" or "vllm": glm5.memory.PLANS) allocates them; None for an architecture without a
    plan."""
    if config.get("model_type") not in PLANNED:
        return None
    import torch

    from qual.runtime.models.glm5.memory import Deployment, memory_plan

    cfg = parse_glm5_config(config, where)
    d = Deployment(tp=tp, dcp=dcp, num_speculative_tokens=num_speculative_tokens, context=context, sequences=sequences,
                   dtype=getattr(torch, dtype), block_size=block_size)
    m = memory_plan(cfg, d, plan)
    parts = (*m.weights.items(), *((f"{group} cache", n) for group, n in m.caches.items()))
    return RankMemory(m.weight_bytes, m.cache_bytes, parts)
