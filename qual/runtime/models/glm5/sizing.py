"""Bytes per rank of a GLM-5.3-Flash deployment: its weights as the loader holds them, and each cache group for a
number of sequences at a context length, both counted by the runtime's own code (the loader over shapes on the
meta device; the cache manager's blocks per request). `bench/glm5_memory.py` prints the table for the real model
(docs/glm5.md, "Memory")."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from types import SimpleNamespace

import torch

from qual.options import DEFAULT_NUMERICS

from qual.runtime.kv_cache import CacheManager
from qual.runtime.models.glm5.config import Glm5Config
from qual.runtime.models.glm5.moe import Fp8Experts
from qual.runtime.models.glm5.numerics import Fp8Weight
from qual.runtime.models.glm5.target import Glm5Target
from qual.runtime.models.glm5.weights import shaped_glm5_weights


def tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of every tensor under obj (dataclasses, lists, FP8 expert stacks), each tensor once (a tied head is the
    embedding)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, (Fp8Experts, Fp8Weight)):
        return tensor_bytes(obj.q, seen) + tensor_bytes(obj.scale, seen)
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o, seen) for o in obj)
    if is_dataclass(obj):
        return sum(tensor_bytes(getattr(obj, f.name), seen) for f in fields(obj))
    return 0


def weight_bytes(cfg: Glm5Config, tp: int, dtype: torch.dtype, numerics: str = DEFAULT_NUMERICS) -> dict[str, int]:
    """One TP rank's weight bytes by part (every rank holds the same amounts), for a run of these numerics."""
    w = shaped_glm5_weights(cfg, 0, tp, dtype, numerics)
    seen: set[int] = set()
    parts = {"embedding": tensor_bytes(w.embed, seen), "lm_head": tensor_bytes(w.lm_head, seen),
             "final norm": tensor_bytes(w.norm, seen)}
    for name, pick in (("KDA", lambda lw: lw.kda), ("MLA", lambda lw: lw.mla), ("DSA indexer", lambda lw: lw.indexer),
                       ("dense MLP", lambda lw: lw.mlp),
                       ("routed experts", lambda lw: lw.moe and (lw.moe.gate, lw.moe.up, lw.moe.down)),
                       ("shared experts", lambda lw: lw.moe and lw.moe.shared),
                       ("router", lambda lw: lw.moe and (lw.moe.router, lw.moe.bias)),
                       ("norms and MHC", lambda lw: (lw.input_norm, lw.post_norm, lw.attn_hc, lw.ffn_hc))):
        parts[name] = sum(tensor_bytes(pick(lw), seen) for lw in w.layers)
    parts["total"] = sum(parts.values())
    return parts


def cache_bytes(cfg: Glm5Config, tp: int, dcp: int, dtype: torch.dtype, num_speculative_tokens: int, context: int,
                sequences: int, block_size: int) -> dict[str, int]:
    """One rank's cache bytes by group for `sequences` requests of `context` tokens each: the blocks the cache
    manager reserves for a request's whole life (sharded groups over the DCP ranks, per-request groups once)."""
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    groups = Glm5Target.cache_groups(cfg, SimpleNamespace(tp_size=tp), dtype_bytes, num_speculative_tokens)
    one_block = sum(g.block_bytes(block_size) for g in groups)  # the pool's size does not change a reservation
    manager = CacheManager(groups, block_size, dcp, memory_bytes=one_block, lookahead=num_speculative_tokens + 1)
    out = {g.name: sequences * manager.lifetime_blocks(g.name, context) * g.block_bytes(block_size) for g in groups}
    out["total"] = sum(out.values())
    return out
