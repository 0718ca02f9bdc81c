"""This rank's caches: every cache group of the target and the drafter, the tensors that hold them, their DCP
geometry, and the target's per-step key views built over them (qual/runtime/cache_views.py)."""

from __future__ import annotations

import torch

from qual.runtime.cache_views import StepShape, build_view, view_geometry
from qual.runtime.config import EngineConfig
from qual.runtime.geometry import blocks_needed
from qual.runtime.kv_cache import KVCacheGroup
from qual.runtime.models.base import TargetMeta
from qual.runtime.paged import Geometry, KeyIndex, KVStore, StateStore, VectorStore


def num_cache_blocks(cfg: EngineConfig, groups: list[KVCacheGroup]) -> int:
    """Blocks every group gets on this rank: the budget over one block index's bytes in every group."""
    return cfg.cache.memory_bytes // sum(g.block_bytes(cfg.cache.block_size) for g in groups)


class RankCaches:
    """The target's and the drafter's cache groups on one rank, with the stores, geometry and static widths a step
    reads them by."""

    def __init__(self, cfg: EngineConfig, comm, target_groups: list[KVCacheGroup], draft_groups: list[KVCacheGroup],
                 K: int, dtype: torch.dtype, state_parts):
        self.comm = comm
        self.groups = target_groups + draft_groups
        self.by_name = {g.name: g for g in self.groups}
        self.target_groups = [g.name for g in target_groups]
        self.draft_groups = [g.name for g in draft_groups]
        self.num_blocks = num_cache_blocks(cfg, self.groups)
        B = cfg.cache.block_size
        self.stores = {g.name: self._store(g, B, K, dtype, state_parts) for g in self.groups}
        self.geometry = {
            g.name: Geometry(B, comm.dcp_size if g.spec.sharded else 1, comm.dcp_rank if g.spec.sharded else 0,
                             cfg.parallel.interleave)
            for g in self.groups
        }
        # draft layer -> (cache group, index inside the group), in the drafter's layer order
        slots = [(int(layer.split(".")[1]), g.name, j) for g in draft_groups for j, layer in enumerate(g.layers)]
        self.layer_slots = [(name, j) for _, name, j in sorted(slots)]
        # Static key widths / table widths for graph-shaped steps: bounded by max_model_len.
        self.max_blocks = {g.name: blocks_needed(g.spec.entries(cfg.max_model_len), B, self.geometry[g.name].dcp_size)
                           for g in self.groups}
        self.key_width = {name: blocks * B for name, blocks in self.max_blocks.items()}  # local tokens of a full table
        # The static widths' key indices, built once: graph steps then build only the step-dependent half of a view.
        self.key_index = {g.name: KeyIndex.build(view_geometry(g.spec, self.geometry[g.name]), self.key_width[g.name],
                                                 self.max_blocks[g.name], comm.device) for g in self.groups}

    def _store(self, g: KVCacheGroup, B: int, K: int, dtype: torch.dtype, state_parts):
        """The tensors of one cache group on this rank, by its kind."""
        s, blocks, dev = g.spec, self.num_blocks, self.comm.device
        if s.kind == "gqa":
            return KVStore(len(g.layers), blocks * B, s.num_kv_heads, s.head_dim, dtype, dev)
        if s.kind in ("latent", "pooled"):
            return VectorStore(len(g.layers), blocks * B, s.head_dim, dtype, dev)
        if s.kind == "ring":
            return VectorStore(len(g.layers), blocks * s.ring, s.head_dim, dtype, dev)
        return StateStore(len(g.layers), blocks, 1 + K, state_parts(g.name), dev)

    @property
    def kv_bytes(self) -> dict[str, int]:
        """Bytes each group's tensors take on this rank."""
        return {name: s.nbytes for name, s in self.stores.items()}

    def route(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """-1 write slots to the group store's trash slot."""
        return self.stores[name].route(slots)

    def target_meta(self, shape: StepShape, tables, widths: dict | None = None, static: bool = False,
                    dense: bool = False, prefill: bool = False) -> TargetMeta:
        """Target metadata: one view per target cache group, by its kind (qual/runtime/cache_views.py), built where
        shape and tables are. static: at the key widths of a full table (graph shapes); else at widths (by group).
        prefill: the tokens are prompts (TargetMeta.prefill)."""
        views = {}
        for name in self.target_groups:
            width = self.key_width[name] if static else (widths or {}).get(name)
            views[name] = build_view(self.by_name[name].spec, self.geometry[name], shape, tables[name],
                                     lambda slots, n=name: self.route(n, slots), width,
                                     self.key_index[name] if static else None)
        return TargetMeta(shape.q_index, views, dense=dense, prefill=prefill)
