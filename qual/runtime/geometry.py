"""Where a token's KV lives under decode context parallelism (docs/dcp.md).

N = dcp_size, I = interleave, B = block_size (tokens per physical block on one rank).
A sharded group has a virtual block of B*N tokens; a replicated group is the N=1 case.
"""

from __future__ import annotations

import torch


def owner_rank(positions: torch.Tensor, dcp_size: int, interleave: int) -> torch.Tensor:
    """DCP rank that stores the KV of each global position."""
    return (positions // interleave) % dcp_size


def blocks_needed(num_tokens: int, block_size: int, dcp_size: int) -> int:
    """Blocks (per rank) a request of num_tokens needs: ceil(L / (B*N))."""
    span = block_size * dcp_size
    return -(-num_tokens // span)


def slot_mapping(
    positions: torch.Tensor,  # [T] global positions
    block_ids: torch.Tensor,  # [T, max_blocks] block table row of each token's request
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
) -> torch.Tensor:
    """Physical slot of each token on this rank, -1 where the token is not local."""
    if dcp_size == 1:  # every token is local, in order within its block: the formula below reduces to this
        block = torch.gather(block_ids, 1, (positions // block_size).unsqueeze(1)).squeeze(1)
        return torch.where(block >= 0, block * block_size + positions % block_size, -1)
    span = block_size * dcp_size
    vblk = positions // span
    off = positions % span
    local = ((off // interleave) % dcp_size) == dcp_rank
    local_off = (off // (dcp_size * interleave)) * interleave + off % interleave
    block = torch.gather(block_ids, 1, vblk.unsqueeze(1)).squeeze(1)
    slots = block * block_size + local_off
    return torch.where(local & (block >= 0), slots, -1)


def local_seq_len(seq_lens: torch.Tensor, dcp_size: int, dcp_rank: int, interleave: int) -> torch.Tensor:
    """Number of a sequence's first L tokens stored on this rank."""
    if dcp_size == 1:
        return seq_lens
    base = (seq_lens // (interleave * dcp_size)) * interleave
    rest = seq_lens - base * dcp_size - dcp_rank * interleave
    return base + rest.clamp(0, interleave)


def local_index_positions(
    num_local: int, block_size: int, dcp_size: int, dcp_rank: int, interleave: int, device=None
) -> torch.Tensor:
    """Global position of this rank's j-th local token, j = 0..num_local-1 (inverse of the slot map)."""
    j = torch.arange(num_local, device=device)
    vblk, lo = j // block_size, j % block_size
    off = (lo // interleave) * (dcp_size * interleave) + dcp_rank * interleave + lo % interleave
    return vblk * block_size * dcp_size + off


def longest_local(local_lens: torch.Tensor) -> int:
    """The key width that holds every request's local tokens (at least 1)."""
    return max(int(local_lens.max()) if local_lens.numel() else 0, 1)


def local_columns(num_local: int, block_size: int, max_blocks: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-table column (clamped to the table's width) and offset in its block of local tokens 0..num_local-1."""
    j = torch.arange(num_local, device=device)
    return (j // block_size).clamp(max=max_blocks - 1), j % block_size


def local_slots(block_ids: torch.Tensor, num_local: int, block_size: int) -> torch.Tensor:
    """Physical slots of local tokens 0..num_local-1 for each request. block_ids: [R, max_blocks] -> [R, num_local]."""
    column, offset = local_columns(num_local, block_size, block_ids.shape[1], block_ids.device)
    return slots_at(block_ids, column, offset, block_size)


def slots_at(block_ids: torch.Tensor, column: torch.Tensor, offset: torch.Tensor, block_size: int) -> torch.Tensor:
    """Physical slots of the local tokens in block-table columns column [S] at offsets offset [S]: [R, S], -1 where
    the block is not allocated."""
    block = block_ids[:, column]
    return torch.where(block >= 0, block * block_size + offset, -1)
