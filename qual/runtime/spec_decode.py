"""Speculative decoding in one place: propose (the drafter's block), verify (the target's tokens), accept.

Device side: `propose` runs the drafter over [last token, MASK * K] and picks K tokens on rank 0 (the argmax, or
`candidate_walk` over a candidate head's edges; every rank then verifies rank 0's proposals); `verify_tokens` is
the target's input [last, d1..dK]. Host side: `accept` is the greedy prefix rule (a sequence counts the result in
its records.AcceptanceCounts, qual/runtime/sequence.py) and `choose` picks a step's tokens (docs/dflash.md).
"""

from __future__ import annotations


import torch

from qual.runtime.sampling import choose_tokens, greedy, top2_margins
from qual.runtime.step_args import NUMBERS, context_sources


def propose(drafter, target, comm, k: int, ctx_features, last_tokens: torch.Tensor, mask_token: torch.Tensor, meta,
            stores, layer_slots) -> torch.Tensor:
    """k draft tokens per request, [P, k]: one drafter forward, then at the mask positions either the argmax of the
    drafter's logits (DFlash) or the walk over its candidate head's edges (DFlash2); greedy at every temperature."""
    P, K = last_tokens.shape[0], k
    block = torch.cat([last_tokens[:, None], mask_token[:1].expand(P, K)], dim=1)
    h = drafter.forward(ctx_features, block, meta, stores, layer_slots)
    # Rank 0 alone runs the LM head and picks; every rank verifies rank 0's proposals.
    if comm.rank == 0:
        logits = drafter.logits(h)
        edges = drafter.candidate_edges(h, logits, last_tokens)
        proposals = logits.argmax(dim=-1) if edges is None else candidate_walk(*edges)
    else:
        proposals = torch.empty(h.shape[:2], dtype=torch.long, device=h.device)
    return comm.broadcast_tensor(proposals.contiguous())


def candidate_walk(candidates: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The greedy path through a candidate head's edges, [P, K] (vLLM's DFlash2 selector walk at temperature 0).

    candidates [P, K, k] are each position's top-k tokens; scores[:, l, p, c] scores candidate c at position l after
    candidate p of position l - 1 (at l = 0 every p is the anchor token). Position l picks the best candidate after
    the one picked at l - 1 (first of equals), starting from row 0. A fixed loop of gathers: no host sync, static shapes.
    """
    P, K, k = candidates.shape
    prev = torch.zeros(P, 1, dtype=torch.long, device=candidates.device)
    picks = []
    for step in range(K):
        row = scores[:, step].gather(1, prev[:, :, None].expand(P, 1, k)).squeeze(1)  # [P, k] after the last pick
        prev = row.argmax(dim=-1, keepdim=True)
        picks.append(candidates[:, step].gather(1, prev))
    return torch.cat(picks, dim=1)


def verify_tokens(last_tokens: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
    """The target's input of a step, [P, Q]: [last, d1..dK] (Q = K + 1), or [last] without a drafter."""
    return last_tokens[:, None] if drafts is None else torch.cat([last_tokens[:, None], drafts], dim=1)


def pack_choices(logits: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
    """Greedy tokens, top-2 margins and proposals of a step, [P, 2Q + K] float64, computed where the logits are so
    that one copy brings them to the host (unpack_choices). float64 holds token ids and float32 margins exactly."""
    tokens, margins = greedy(logits)
    parts = [tokens.double(), margins.double()]
    if drafts is not None:
        parts.append(drafts.double())
    return torch.cat(parts, dim=1)


def unpack_choices(host: torch.Tensor, q: int) -> tuple[list, list, list | None]:
    """(tokens [R][Q], margins [R][Q], proposals [R][K] or None) from pack_choices' [R, 2Q + K] on the host. The ids
    as ints through one conversion of the whole tensor (a Python int() per id cost more, every decode launch)."""
    rows, ints = host.tolist(), host.long().tolist()  # the margins' columns of ints are not read
    tokens = [row[:q] for row in ints]
    margins = [row[q : 2 * q] for row in rows]
    proposals = [row[2 * q :] for row in ints] if host.shape[1] > 2 * q else None
    return tokens, margins, proposals


def advance(args, choices: torch.Tensor, aux: torch.Tensor | None, feats: torch.Tensor | None, k: int) -> None:
    """The next decode step's inputs from this one's results, in place and on the device (async decode): what the
    host would send after committing the step with accept(), for requests that go on.

    args: the step's StepArgs (its numbers are overwritten); choices: pack_choices' [P, 2Q + K]; aux [P*Q, n*H]
    and feats [num_ctx, n*H]: the accepted tokens' aux features become the next step's draft context, packed
    request after request as the host packs them (context_rows). Pad rows (sequence length 0) stay pad rows.
    """
    q = k + 1
    tokens = choices[:, :q].long()  # [P, Q]
    if k:
        agree = (choices[:, 2 * q :].long() == tokens[:, :k]).long()  # proposal j equals the target's choice j
        accepted = agree.cumprod(dim=1).sum(dim=1)  # [P] the longest agreeing prefix
    else:
        accepted = torch.zeros_like(tokens[:, 0])
    committed, counts, ctx_len = (args.number(n) for n in ("num_committed", "commit_counts", "ctx_len"))
    real = args.number("seq_lens") > 0
    new_committed = committed + accepted + 1
    # Without a drafter there is no draft context to commit: those two rows stay as the host sends them.
    nxt = torch.stack([tokens.gather(1, accepted[:, None]).squeeze(1), new_committed, new_committed + k,
                       accepted + 1 if k else counts, ctx_len + counts if k else ctx_len])
    new_counts = torch.where(real, accepted + 1, 0)
    if feats is not None:
        pack_context(feats, aux, new_counts, q)
    # A padding row stays padding, and commits no draft context next step (a retired row's count was packed for
    # this step only: step_args.retire)
    idle = args.numbers.clone()
    idle[NUMBERS.index("commit_counts")] = 0
    args.numbers.copy_(torch.where(real, nxt, idle))


def join_rows(numbers: torch.Tensor, table: torch.Tensor, feats: torch.Tensor | None, aux: torch.Tensor | None,
              q: int) -> None:
    """Rows that requests held ready take over in a launch ahead, in place and on the device: where table[0] is set,
    the step's numbers [5, P] become table[1:] (join_table: the host's numbers for those rows), and the draft context
    is packed again from the last launch's aux by the amended commit counts. Fixed shapes and no host values, so a
    CUDA graph replays it (qual/runtime/cuda_graphs.py) as eagerly run."""
    numbers.copy_(torch.where(table[0].bool()[None], table[1:], numbers))
    if feats is not None:
        pack_context(feats, aux, numbers[NUMBERS.index("commit_counts")], q)


def pack_context(feats: torch.Tensor, aux: torch.Tensor, counts: torch.Tensor, q: int) -> None:
    """The draft context of a step, in place: each row's first counts[i] aux features of the step before ([P*Q, n*H]),
    packed request after request as the host packs them (context_rows), zeros after."""
    rows, offset = context_sources(counts, feats.shape[0])
    feats.copy_(torch.where((rows >= 0)[:, None], aux[rows.clamp(min=0) * q + offset], 0))


def accept(drafts: list[int], targets: list[int]) -> int:
    """Greedy acceptance: the longest prefix of drafts equal to the target's choices."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def choose(logits: torch.Tensor, request_ids: list[str], first_positions: list[int], sampling) -> tuple[list, list]:
    """Token choices and top-2 margins for logits [R, Q, V], as lists per request (sampling: SamplingParams).

    Greedy picks happen where the logits are, so only [R, Q] numbers cross to the host; sampling draws its
    position-keyed noise on the CPU (the same text on every device).
    """
    if sampling.temperature == 0:  # tokens and margins in one copy
        tokens, margins, _ = unpack_choices(pack_choices(logits, None).cpu(), logits.shape[1])
        return tokens, margins
    margins = top2_margins(logits).tolist()
    host = logits.float().cpu()
    return [choose_tokens(host[i], sampling.temperature, sampling.seed, rid, n)
            for i, (rid, n) in enumerate(zip(request_ids, first_positions))], margins
