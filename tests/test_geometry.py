"""Slot mapping and local lengths against docs/dcp.md, exhaustively on small cases."""

import itertools

import torch

from qual.runtime.geometry import blocks_needed, local_index_positions, local_seq_len, local_slots, owner_rank, slot_mapping

CASES = [(B, N, I) for B, N, I in itertools.product([1, 2, 4, 8], [1, 2, 3, 4], [1, 2, 4]) if B >= I and B % I == 0]


def reference_slot(p, block_table, B, N, r, I):
    """docs/dcp.md's formulas, written out literally."""
    vblk, off = p // (B * N), p % (B * N)
    if (off // I) % N != r:
        return -1
    return block_table[vblk] * B + (off // (N * I)) * I + off % I


def test_slot_mapping_matches_formula():
    for B, N, I in CASES:
        L = 3 * B * N + 5
        nblk = blocks_needed(L, B, N)
        table = torch.randperm(50)[:nblk]
        pos = torch.arange(L)
        for r in range(N):
            got = slot_mapping(pos, table.expand(L, -1), B, N, r, I).tolist()
            want = [reference_slot(p, table.tolist(), B, N, r, I) for p in range(L)]
            assert got == want, (B, N, I, r)


def test_each_position_has_exactly_one_owner_and_distinct_slots():
    for B, N, I in CASES:
        L = 4 * B * N
        table = torch.arange(blocks_needed(L, B, N))
        pos = torch.arange(L)
        slots = torch.stack([slot_mapping(pos, table.expand(L, -1), B, N, r, I) for r in range(N)])
        assert ((slots >= 0).sum(0) == 1).all()
        assert torch.equal((slots >= 0).float().argmax(0), owner_rank(pos, N, I))
        for r in range(N):
            mine = slots[r][slots[r] >= 0]
            assert len(set(mine.tolist())) == len(mine)


def test_local_seq_len_counts_owned_positions():
    for B, N, I in CASES:
        for L in range(0, 3 * N * I + 7):
            for r in range(N):
                want = sum(1 for p in range(L) if (p // I) % N == r)
                assert int(local_seq_len(torch.tensor([L]), N, r, I)[0]) == want, (L, N, r, I)


def test_local_index_inverts_the_slot_map():
    for B, N, I in CASES:
        L = 3 * B * N + 1
        table = torch.arange(blocks_needed(L, B, N))
        for r in range(N):
            n_local = int(local_seq_len(torch.tensor([L]), N, r, I)[0])
            owned = [p for p in range(L) if (p // I) % N == r]
            assert local_index_positions(n_local, B, N, r, I).tolist() == owned
            # local token j lives in the slot the slot map gave its position
            slots = local_slots(table[None, :], n_local, B)[0].tolist()
            assert slots == slot_mapping(torch.tensor(owned), table.expand(len(owned), -1), B, N, r, I).tolist()


def test_replicated_group_is_dcp1_geometry():
    B, L = 4, 37
    table = torch.arange(blocks_needed(L, B, 1))
    pos = torch.arange(L)
    slots = slot_mapping(pos, table.expand(L, -1), B, 1, 0, 1)
    assert slots.tolist() == list(range(L))
    assert int(local_seq_len(torch.tensor([L]), 1, 0, 1)[0]) == L
    assert blocks_needed(L, B, 1) == 10 and blocks_needed(L, B, 4) == 3


def test_unallocated_block_gives_pad_slot():
    table = torch.tensor([[3, -1]])
    assert slot_mapping(torch.tensor([0, 5]), table.expand(2, -1), 4, 1, 0, 1).tolist() == [12, -1]


def test_key_view_lengths_bound_the_valid_keys_in_a_static_width():
    """Attention kernels read a row's keys only up to KeyView.lengths: no valid key may lie at or past it, and
    in a graph's static width (S > the row's keys) everything past it is padding."""
    from qual.runtime.paged import Geometry, key_view

    for B, N, I in CASES:
        for r in range(N):
            seq_lens = torch.tensor([0, 1, 2 * B * N + 3, 5 * B * N])
            table = torch.randperm(60)[: 5 * 4].view(4, 5)
            for width in (None, 6 * B):
                view = key_view(Geometry(B, N, r, I), table, seq_lens, width=width)
                S = view.valid.shape[1]
                beyond = torch.arange(S)[None, :] >= view.lengths[:, None].long()
                assert view.lengths.dtype == torch.int32 and not (view.valid & beyond).any(), (B, N, I, r, width)
                assert torch.equal(view.lengths.long(), view.valid.sum(1)), (B, N, I, r, width)  # prefix, no holes
