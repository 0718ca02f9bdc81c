"""Per-step views of every cache group on this rank, built from rank-independent step metadata by the group's kind.

gqa / latent: where each new token is written here, which local keys each request reads, and the causal mask.
pooled: where each pool completed in this step is written (its owner rank only), and the local pools each request
holds (positions are pool ids). ring: each request's ring base slot (position p lives at base + p % ring).
state: each request's state slot and which of the last step's per-position states is its committed one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qual.runtime.geometry import local_seq_len, longest_local
from qual.runtime.kv_cache import KVCacheSpec
from qual.runtime.models.base import AttentionView
from qual.runtime.paged import Geometry, KeyIndex, causal_mask, key_view, write_slots


@dataclass
class RingView:
    write_slots: torch.Tensor  # [T] slot of each new token's entry (base + position % ring)
    base: torch.Tensor  # [R] first slot of each request's ring
    ring: int


@dataclass
class PooledView:
    write_slots: torch.Tensor  # [T] slot of the pool each new token completes (not completing, not held: trash)
    keys: object  # KeyView over the pools this rank holds (positions: global pool ids)
    mask: torch.Tensor  # [R, Q, S_p] the pool is held here, complete, and its last token visible to the query
    ids: torch.Tensor  # [S_p] global pool id of each local pool (the same for every request)


@dataclass
class StateView:
    slots: torch.Tensor  # [R] each request's state slot (pad rows: the trash slot)
    commit: torch.Tensor  # [R] which of the last step's per-position states is the request's state now


def pool_geometry(geo: Geometry, pool: int) -> Geometry:
    """DCP geometry in pool units: a pool is the sharding unit of pooled caches (interleave in whole pools)."""
    return Geometry(geo.block_size, geo.dcp_size, geo.dcp_rank, max(1, geo.interleave // pool))


@dataclass
class StepShape:
    """Rank-independent metadata of one forward, as every view needs it (where the views are built)."""

    positions: torch.Tensor  # [T] global positions of the new tokens
    rows: torch.Tensor  # [T] request row of each new token
    q_index: torch.Tensor  # [R, Q] flat token index, -1 = padding
    seq_lens: torch.Tensor  # [R] tokens in the sequence once this step's tokens are in
    commit: torch.Tensor  # [R] per-position state to commit (state groups)


def view_geometry(spec: KVCacheSpec, geo: Geometry) -> Geometry:
    """The geometry a group's key view is laid out in: pools for a pooled group, tokens otherwise."""
    return pool_geometry(geo, spec.pool) if spec.kind == "pooled" else geo


def view_width(spec: KVCacheSpec, geo: Geometry, seq_lens: torch.Tensor) -> int:
    """The key width a view of sequences seq_lens [R] needs here: the longest local sequence (key_view's default),
    reckoned from host lengths so that a device never syncs for it."""
    g = view_geometry(spec, geo)
    local = local_seq_len(seq_lens // spec.pool if spec.kind == "pooled" else seq_lens, g.dcp_size, g.dcp_rank,
                          g.interleave)
    return longest_local(local)


def build_view(spec: KVCacheSpec, geo: Geometry, step: StepShape, table: torch.Tensor, route, width: int | None,
               index: KeyIndex | None = None):
    """The view of one group on this rank, built where the step's tensors are (no host sync given a width).

    route maps -1 write slots to the group store's trash slot; width fixes the key dimension (graph shapes), and
    index, where given, is that width's KeyIndex in view_geometry (built once).
    """
    q_pos = step.positions[step.q_index.clamp(min=0)]  # [R, Q]
    if spec.kind in ("gqa", "latent"):
        keys = key_view(geo, table, step.seq_lens, width=width, index=index)
        mask = causal_mask(q_pos, step.q_index, keys)
        positions = keys.positions.clone() if spec.kind == "latent" else None
        return AttentionView(route(write_slots(geo, step.positions, step.rows, table)), keys, mask, positions)
    if spec.kind == "pooled":
        pgeo = pool_geometry(geo, spec.pool)
        completes = (step.positions + 1) % spec.pool == 0
        pools = torch.where(completes, step.positions // spec.pool, 0)  # others are never written (nor mapped)
        slots = write_slots(pgeo, pools, step.rows, table)
        slots = torch.where(completes, slots, -1)
        keys = key_view(pgeo, table, step.seq_lens // spec.pool, width=width, index=index)
        visible = (keys.positions[:, None, :] + 1) * spec.pool - 1 <= q_pos[:, :, None]
        mask = keys.valid[:, None, :] & visible & (step.q_index >= 0)[:, :, None]
        return PooledView(route(slots), keys, mask, keys.positions[0].clone())
    if spec.kind == "ring":
        base = table[:, 0].clamp(min=0) * spec.ring
        # Only a request's last `ring` positions of the step are stored: a prefill longer than the ring would write
        # each slot more than once, and which of those writes lands is unspecified on a GPU (index_copy_), so the
        # ring could keep an early position's entry instead of the last one's (tests/test_glm5_runtime.py)
        last = step.positions >= step.seq_lens[step.rows] - spec.ring
        slots = torch.where((table[step.rows, 0] >= 0) & last, base[step.rows] + step.positions % spec.ring, -1)
        return RingView(route(slots), base, spec.ring)
    if spec.kind == "state":
        return StateView(route(table[:, 0]), step.commit)
    raise ValueError(f"no view for cache kind {spec.kind!r}")


def draft_mask(keys, block_positions: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor:
    """[R, Q, S + Q]: which [context ; block] keys each draft-block query sees (on the inputs' device).

    A query at position p sees a stored context key at c if the view holds it and, in a windowed layer, p - c <
    window; a block key at q always in a non-causal layer, q <= p in a causal one, and in a windowed layer only
    |p - q| < window. That is vLLM's per-query-token window: FlashAttention's (window - 1, 0) when causal, made
    symmetric (window - 1, window - 1) when not.
    """
    R, Q = block_positions.shape
    p = block_positions[:, :, None]
    ctx = keys.valid[:, None, :].expand(R, Q, -1)
    if window is not None:
        ctx = ctx & (p - keys.positions[:, None, :] < window)
    d = p - block_positions[:, None, :]  # [R, Q, Q] query position minus key position
    own = torch.ones(R, Q, Q, dtype=torch.bool, device=block_positions.device)
    if causal:
        own &= d >= 0
    if window is not None:
        own &= d.abs() < window
    return torch.cat([ctx, own], dim=2)
