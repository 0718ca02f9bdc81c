"""A decode step's host-built numbers (qual/runtime/step_args.py) and its one-copy readback (spec_decode)."""

import torch

from qual.runtime.sampling import greedy_by_reductions
from qual.runtime.spec_decode import advance, join_rows, pack_choices, unpack_choices
from qual.runtime.step_args import NUMBERS, StepArgs, Stager, context_rows, flat_views, join_table, pack, retire


def test_context_rows_pack_each_requests_accepted_tokens_in_order():
    g = torch.Generator().manual_seed(0)
    for P, Q in [(1, 8), (5, 4), (16, 8)]:
        for _ in range(20):
            counts = torch.randint(0, Q + 1, (P,), generator=g)
            ctx_len = torch.randint(0, 300, (P,), generator=g)
            for num_ctx in (int(counts.sum()), P * Q):  # as eager steps pack them, and padded (graphs)
                pos, rows = context_rows(counts, ctx_len, num_ctx)
                want_pos = [int(s) + j for s, c in zip(ctx_len, counts) for j in range(int(c))]
                want_rows = [i for i, c in enumerate(counts) for _ in range(int(c))]
                pad = num_ctx - len(want_pos)
                assert pos.tolist() == want_pos + [0] * pad
                assert rows.tolist() == want_rows + [-1] * pad


def test_flat_views_and_the_cpu_stager_keep_every_number():
    numbers = torch.arange(15).view(5, 3)
    tables = {"target": torch.tensor([[4, 5], [6, -1], [-1, -1]]), "draft": torch.tensor([[1], [2], [3]])}
    args = StepArgs(numbers, tables, num_ctx=7)
    stager = Stager(torch.device("cpu"))
    assert stager.send(args) is args  # on the CPU the numbers already are where the step reads them
    flat = torch.empty(args.numel, dtype=torch.long)
    got = stager.send(args, into=flat)  # a graph's static inputs: one flat buffer, refilled in place
    assert torch.equal(got.numbers, numbers) and got.num_ctx == 7
    assert all(torch.equal(got.tables[k], tables[k]) for k in tables)
    assert got.numbers.data_ptr() == flat.data_ptr()
    again = flat_views(flat, args)
    assert torch.equal(again.number("commit_counts"), numbers[3])


def test_packed_args_travel_from_their_one_buffer_whole_or_tables_only():
    """pack's StepArgs are views of one host buffer (StepArgs.flat), which the stager copies as it is; the same
    numbers without that buffer go by concatenation: a graph's inputs come out the same either way, refilled whole or
    (a launch ahead) tables only, the numbers left as they were."""
    numbers = [[7, 8, 0], [3, 4, 1], [10, 11, 1], [2, 0, 0], [5, 6, 0]]
    tables = {"target": [[4, 5], [6]], "draft": [[1, 2, 3], [9]]}
    args = pack(numbers, tables, 3, {"target": 4}, num_ctx=9)
    assert args.flat is not None and args.flat.numel() == args.numel == 15 + 3 * 4 + 3 * 3
    assert args.numbers.tolist() == numbers and args.tables["target"].tolist() == [[4, 5, -1, -1], [6, -1, -1, -1], [-1] * 4]
    assert args.tables["draft"].tolist() == [[1, 2, 3], [9, -1, -1], [-1, -1, -1]]
    loose = StepArgs(args.numbers.clone(), {k: v.clone() for k, v in args.tables.items()}, 9)  # no one buffer
    stager = Stager(torch.device("cpu"))
    for tables_only in (False, True):
        got = []
        for a in (args, loose):
            into = torch.full((args.numel,), -7, dtype=torch.long)
            sent = stager.send(a, into=into, tables_only=tables_only)
            assert sent.flat is into and sent.numbers.data_ptr() == into.data_ptr()
            got.append(into)
        assert torch.equal(got[0], got[1])
        assert (got[0][:15] == -7).all() if tables_only else torch.equal(got[0][:15], args.numbers.reshape(-1))
        assert torch.equal(got[0][15:], args.flat[15:])


def test_packed_choices_are_the_greedy_tokens_margins_and_proposals():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        logits = torch.randn(3, 4, 50, generator=g).to(dtype)
        drafts = torch.randint(0, 50, (3, 3), generator=g)
        tokens, margins, proposals = unpack_choices(pack_choices(logits, drafts), 4)
        assert tokens == logits.argmax(dim=-1).tolist()
        top = logits.topk(2, dim=-1).values.float()
        assert margins == (top[..., 0] - top[..., 1]).tolist()  # float32 values, exactly
        assert proposals == drafts.tolist()
        assert unpack_choices(pack_choices(logits, None), 4)[2] is None


def test_greedy_by_reductions_is_torchs_argmax_and_top2_margin_also_on_ties():
    """The form CUDA runs (sampling.greedy_by_reductions), here on the CPU: the first of equal maxima, as
    torch.argmax; a tie at the top is a margin of 0, as topk gives it. bfloat16 logits of a coarse grid tie often, at
    the top and below it."""
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for shape in [(7, 1000), (2, 3, 151936), (1, 2)]:
            logits = (torch.randn(shape, generator=g) * 4).round().to(dtype)  # integers: many equal values
            logits[0, ..., -1] = logits[0].max() + 1  # the maximum in the last column once
            if shape[-1] > 2:
                logits[-1, ..., 3] = logits[-1, ..., 5] = logits[-1].max() + 1  # two equal maxima: the first wins
            token, margin = greedy_by_reductions(logits)
            assert torch.equal(token, logits.argmax(dim=-1)), (dtype, shape)
            top = logits.topk(2, dim=-1).values.float()
            assert torch.equal(margin, top[..., 0] - top[..., 1]), (dtype, shape)
            assert margin.dtype == torch.float32 and (margin[-1] == 0).all() == (shape[-1] > 2)


def test_a_retired_row_stops_advancing_and_commits_no_context():
    """step_args.retire makes a row padding: spec_decode.advance then leaves its numbers where they are (a finished
    request's row must not walk past its block table) and gives it no draft context next step, while the rows
    around it advance as before."""
    K, Q = 3, 4
    # rows: last token, committed, sequence length, commit count, context length (step_args.NUMBERS)
    numbers = torch.tensor([[11, 12, 13], [20, 30, 40], [23, 33, 43], [2, 3, 1], [15, 25, 35]])
    proposals = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    targets = torch.tensor([[5, 6, 9, 1], [5, 6, 7, 8], [9, 1, 1, 1]])  # accepts 2, 3 and 0 proposals
    logits = torch.nn.functional.one_hot(targets, 50).double()
    aux = torch.arange(3 * Q * 2, dtype=torch.float64).view(3 * Q, 2)
    before = numbers.clone()
    for retired in ([], [1]):
        args = StepArgs(numbers.clone(), {}, num_ctx=3 * Q)
        retire(args.numbers, retired)
        feats = torch.zeros(3 * Q, 2, dtype=torch.float64)
        advance(args, pack_choices(logits, proposals), aux, feats, K)
        got = args.numbers
        assert got[:, 0].tolist() == [9, 23, 26, 3, 17] and got[:, 2].tolist() == [9, 41, 44, 1, 36]
        if retired:
            assert got[:, 1].tolist() == [12, 30, 0, 0, 25]  # where it was; sequence length 0; no context
            assert torch.equal(feats[3:4], aux[8:9]) and not feats[4:].any()  # row 2's one token follows row 0's
        else:
            assert got[:, 1].tolist() == [8, 34, 37, 4, 28]
            assert torch.equal(feats[3:7], aux[4:8])
    assert torch.equal(numbers, before)


def test_rows_taken_over_get_the_hosts_numbers_and_the_context_is_packed_by_them():
    """spec_decode.join_rows (what a graph's join replays): the joined rows' numbers become the host's, the others
    keep the device's, and the draft context is each row's first commit-count aux rows of the last launch, packed
    request after request, zeros after; as the host computes it row by row."""
    g = torch.Generator().manual_seed(1)
    P, Q, W = 6, 4, 3
    for joined in ([0], [2, 5], [1, 3, 4], list(range(P))):
        device = torch.randint(0, 9, (len(NUMBERS), P), generator=g)
        device[NUMBERS.index("commit_counts")] = torch.randint(0, Q + 1, (P,), generator=g)
        host = torch.randint(0, 9, (len(NUMBERS), P), generator=g)
        host[NUMBERS.index("commit_counts")] = torch.randint(0, Q + 1, (P,), generator=g)
        aux = torch.randn(P * Q, W, generator=g, dtype=torch.float64)
        numbers, feats = device.clone(), torch.full((P * Q, W), 7.0, dtype=torch.float64)
        join_rows(numbers, join_table(joined, host), feats, aux, Q)
        want = device.clone()
        want[:, joined] = host[:, joined]
        assert torch.equal(numbers, want)
        counts = want[NUMBERS.index("commit_counts")].tolist()
        packed = [aux[i * Q + j] for i, c in enumerate(counts) for j in range(c)]
        assert packed, "every case commits some context"
        assert torch.equal(feats[: len(packed)], torch.stack(packed)) and not feats[len(packed):].any()
        numbers = device.clone()
        join_rows(numbers, join_table(joined, host), None, None, Q)  # plain decoding: no draft context
        assert torch.equal(numbers, want)
