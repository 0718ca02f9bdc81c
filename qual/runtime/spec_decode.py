"""Speculative decoding in one place: propose (the drafter's block), verify (the target's tokens), accept.

Device side: `propose` runs the drafter over [last token, MASK * K] and picks K tokens on rank 0 (every
rank then verifies rank 0's proposals); `verify_tokens` is the target's input [last, d1..dK]. Host side:
`accept` is the greedy prefix rule and `SpecStats` the per-request counts (docs/dflash.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def propose(drafter, target, comm, k: int, ctx_features, last_tokens: torch.Tensor, mask_token: torch.Tensor, meta,
            stores, layer_slots) -> torch.Tensor:
    """k draft tokens per request, [P, k]: one drafter forward, argmax at the mask positions (greedy drafting)."""
    P, K = last_tokens.shape[0], k
    block = torch.cat([last_tokens[:, None], mask_token[:1].expand(P, K)], dim=1)
    h = drafter.forward(ctx_features, block, meta, stores, layer_slots)
    # Rank 0 alone runs the LM head and picks; every rank verifies rank 0's proposals.
    if comm.rank == 0:
        proposals = target.logits(h).argmax(dim=-1)
    else:
        proposals = torch.empty(h.shape[:2], dtype=torch.long, device=h.device)
    return comm.broadcast_tensor(proposals.contiguous())


def verify_tokens(last_tokens: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
    """The target's input of a step, [P, Q]: [last, d1..dK] (Q = K + 1), or [last] without a drafter."""
    return last_tokens[:, None] if drafts is None else torch.cat([last_tokens[:, None], drafts], dim=1)


def accept(drafts: list[int], targets: list[int]) -> int:
    """Greedy acceptance: the longest prefix of drafts equal to the target's choices."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


@dataclass
class SpecStats:
    """One request's speculative-decoding counts (vLLM's definitions, docs/vllm.md)."""

    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # (committed tokens when drafted, proposals): lets a comparison find draft steps taken at identical context
    draft_steps: list[list] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.k

    def record(self, num_committed: int, proposals: list[int], targets: list[int]) -> int:
        """Count one verify step; returns how many drafts were accepted (a: commit a + 1 target tokens)."""
        a = accept(proposals, targets)
        self.drafts += 1
        self.draft_tokens += self.k
        self.accepted += a
        for j in range(a):
            self.accepted_per_pos[j] += 1
        self.draft_steps.append([num_committed, proposals])
        return a
