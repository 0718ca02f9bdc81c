"""What rank 0 broadcasts each step: rank-independent metadata only (every rank derives its own slots)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillStep:
    """Run the target over whole prompts; their aux hidden states become pending draft context."""

    req_ids: list[str]
    prompts: list[list[int]]
    tables: dict[str, list[list[int]]]  # group -> each request's block ids (CacheManager.block_rows)
    finished: list[str] = field(default_factory=list)


@dataclass
class DecodeStep:
    """One generation step for running requests: a DFlash draft + verify, or one plain target token."""

    req_ids: list[str]
    last_tokens: list[int]  # last committed token (not yet run through the target)
    num_committed: list[int]  # committed length n (prompt + output); last token sits at n-1
    ctx_len: list[int]  # draft context length before this step (positions < ctx_len are in the draft cache)
    commit_counts: list[int]  # pending features that become draft context now
    # group -> each request's block ids (CacheManager.block_rows); None (an advanced step only): the tables the last
    # launch of this batch size sent, still on the device
    tables: dict[str, list[list[int]]] | None
    finished: list[str] = field(default_factory=list)
    # Async decode: the same requests as the last step, launched before its results were read; the device advanced
    # that step's numbers itself (spec_decode.advance), so only the tables are new and the lists above are stale.
    advanced: bool = False
    # Rows of an advanced step whose requests finished while the step before was in flight: padding from this step
    # on (sequence length 0 on the device, tables -1 from the host), so the run of steps goes on for the others.
    retired: list[int] = field(default_factory=list)
    # (row, index in the last prefill): requests whose last token is that prefill's greedy choice, launched before
    # the host read it (last_tokens holds a placeholder there; the device fills it in)
    first_rows: list[tuple[int, int]] = field(default_factory=list)
    # Rows of an advanced step that requests held ready take over (EngineConfig.prefill_ahead) from requests seen
    # finished: their numbers are the host's lists above, not the device's, and the draft context the device packed
    # for the step is packed again with their counts (ModelRunner._amend)
    joined: list[int] = field(default_factory=list)
    # Steps this launch runs back to back, each advancing the next one's inputs on the device (async decode only;
    # EngineConfig.steps_per_launch): its choices come back as [steps, R, 2Q + K]
    steps: int = 1

    def __post_init__(self) -> None:
        if self.tables is None and (self.retired or self.joined or self.first_rows or not self.advanced):
            raise ValueError("a decode step without tables is a launch ahead whose rows and tables are the last one's")


@dataclass
class StepOutput:
    """Rank 0's view of a step's results."""

    logits: torch.Tensor  # prefill: [R, V]; plain decode: [R, 1, V]; spec decode: [R, K+1, V]
    draft_tokens: torch.Tensor | None = None  # [R, K]
    # step_args.PendingReadback of pack_choices' [R, 2Q + K] (tokens, margins, proposals; prefill: Q = 1), a decode launch's
    # stacked per step [steps, R, 2Q + K]
    choices: object = None
