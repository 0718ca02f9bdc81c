"""Per-step paged-KV views: where this rank writes new K/V and which local keys each request reads.

Built once per step and group from rank-independent metadata, shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qual.runtime.geometry import (local_columns, local_index_positions, local_seq_len, longest_local, slot_mapping,
                                   slots_at)


@dataclass
class Geometry:
    """How a cache group lays tokens out on this rank."""

    block_size: int
    dcp_size: int  # 1 for replicated groups
    dcp_rank: int
    interleave: int


@dataclass
class KeyView:
    """Local keys of each request: slots to gather and their global positions."""

    slots: torch.Tensor  # [R, S] clamped to >= 0
    positions: torch.Tensor  # [R, S] global positions
    valid: torch.Tensor  # [R, S] local, allocated, inside the window
    lengths: torch.Tensor  # [R] int32: valid is False from here on (the rest of S pads a static width)


def write_slots(geo: Geometry, positions: torch.Tensor, rows: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Slots on this rank for tokens at positions [T] of requests rows [T]; -1 = not stored here."""
    if positions.numel() == 0:
        return positions
    return slot_mapping(positions, block_table[rows], geo.block_size, geo.dcp_size, geo.dcp_rank, geo.interleave)


@dataclass(frozen=True)
class KeyIndex:
    """The step-independent half of a key view of width S on this rank (local token j = 0..S-1): where each local
    token lies in the block table and its global position. A fixed width (graph shapes) builds it once."""

    j: torch.Tensor  # [S]
    positions: torch.Tensor  # [S] global position of local token j
    column: torch.Tensor  # [S] its block-table column (clamped to the table's width)
    offset: torch.Tensor  # [S] its offset in that block

    @classmethod
    def build(cls, geo: Geometry, width: int, max_blocks: int, device=None) -> "KeyIndex":
        positions = local_index_positions(width, geo.block_size, geo.dcp_size, geo.dcp_rank, geo.interleave, device)
        return cls(torch.arange(width, device=device), positions, *local_columns(width, geo.block_size, max_blocks, device))


def key_view(
    geo: Geometry, block_table: torch.Tensor, seq_lens: torch.Tensor, window_start: torch.Tensor | None = None,
    width: int | None = None, index: KeyIndex | None = None,
) -> KeyView:
    """Keys at global positions < seq_lens [R] held by this rank (positions >= window_start where given).

    width fixes the key dimension S (static shapes for CUDA graphs), index gives that width's KeyIndex built
    beforehand; default: the longest local sequence.
    """
    local = local_seq_len(seq_lens, geo.dcp_size, geo.dcp_rank, geo.interleave)
    if index is None:
        S = width or longest_local(local)
        index = KeyIndex.build(geo, S, block_table.shape[1], block_table.device)
    S = index.j.shape[0]
    slots = slots_at(block_table, index.column, index.offset, geo.block_size)
    pos = index.positions.expand(len(seq_lens), S)
    valid = (index.j[None, :] < local[:, None]) & (slots >= 0)
    if window_start is not None:
        valid &= pos >= window_start[:, None]
    return KeyView(slots.clamp(min=0), pos, valid, local.clamp(max=S).to(torch.int32))


def causal_mask(q_positions: torch.Tensor, q_index: torch.Tensor, keys: KeyView) -> torch.Tensor:
    """[R, Q, S]: key visible if stored here and not after the query."""
    return keys.valid[:, None, :] & (keys.positions[:, None, :] <= q_positions[:, :, None]) & (q_index >= 0)[:, :, None]


class KVStore:
    """K/V tensors of one cache group on one rank: per layer [num_blocks * B + 1, kv_heads, D].

    The extra last slot is a trash slot: pad slots (-1) are written there, so a write has
    a static shape (CUDA graphs) and never needs a data-dependent mask.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype, device):
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.trash = num_slots
        # One tensor per kind, viewed per layer: a kernel that walks the layers needs one base pointer.
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))

    def route(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots as write() takes them: -1 (not stored here) goes to the trash slot."""
        return torch.where(slots >= 0, slots, self.trash)

    def write(self, layer: int, routed: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, D] into slots `routed` (see route(); done once per step, not per layer)."""
        self.k[layer].index_copy_(0, routed, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, routed, v.to(self.v[layer].dtype))

    def gather(self, layer: int, view: KeyView) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, S, kv_heads, D] each."""
        return self.k[layer][view.slots], self.v[layer][view.slots]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_all, self.v_all))


class VectorStore:
    """One vector per slot per layer: [num_slots + 1, width] each (an MLA latent, a pooled index key, a ring entry);
    the last slot is the trash slot, as in KVStore."""

    def __init__(self, num_layers: int, num_slots: int, width: int, dtype, device):
        self.trash = num_slots
        self.all = torch.zeros((num_layers, num_slots + 1, width), dtype=dtype, device=device)
        self.layers = list(self.all.unbind(0))

    def route(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(slots >= 0, slots, self.trash)

    def write(self, layer: int, routed: torch.Tensor, x: torch.Tensor) -> None:
        """x [T, width] into slots `routed`."""
        self.layers[layer].index_copy_(0, routed, x.to(self.all.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """[..., width] at slots [...] (clamped >= 0)."""
        return self.layers[layer][slots]

    @property
    def nbytes(self) -> int:
        return self.all.numel() * self.all.element_size()


class StateStore:
    """A fixed-size state per request slot and layer, kept for each of the last step's Q positions so that a
    speculative verify commits the state after its last accepted token (no recomputation). Named parts of
    their own shapes and dtypes, each [num_layers, num_slots + 1, Q, *shape]; the last slot is the trash slot."""

    def __init__(self, num_layers: int, num_slots: int, positions: int, parts: dict[str, tuple[tuple, torch.dtype]],
                 device):
        self.trash = num_slots
        self.parts = {name: torch.zeros((num_layers, num_slots + 1, positions, *shape), dtype=dtype, device=device)
                      for name, (shape, dtype) in parts.items()}

    def route(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(slots >= 0, slots, self.trash)

    def read(self, layer: int, slots: torch.Tensor, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state after position index[r] of the last step, for request slots [R] -> {part: [R, *shape]}."""
        return {name: t[layer][slots, index] for name, t in self.parts.items()}

    def write(self, layer: int, slots: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        """{part: [R, Q', *shape]}: the states after each of this step's Q' <= Q positions."""
        for name, t in self.parts.items():
            q = states[name].shape[1]
            t[layer][slots, :q] = states[name].to(t.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


def pad_queries(x: torch.Tensor, index: torch.Tensor, dense: bool = False) -> torch.Tensor:
    """Flat tokens x [T, ...] -> padded [R, Q, ...] using index [R, Q] (-1 = padding, filled with 0).

    dense: every request has exactly Q tokens, in order (decode), so this is a reshape.
    """
    if dense:
        return x.view(*index.shape, *x.shape[1:])
    out = x[index.clamp(min=0)]
    return out * (index >= 0).view(*index.shape, *([1] * (x.dim() - 1))).to(x.dtype)


def unpad(x: torch.Tensor, index: torch.Tensor, num_tokens: int, dense: bool = False) -> torch.Tensor:
    """Padded [R, Q, ...] back to flat [T, ...] (dense: every request has Q tokens, in order)."""
    if dense:
        return x.reshape(num_tokens, *x.shape[2:])
    keep = index >= 0
    out = x.new_empty((num_tokens, *x.shape[2:]))
    out[index[keep]] = x[keep]
    return out
