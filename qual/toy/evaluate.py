"""Stage 7: a greedy speculative loop (batch 1, full recompute) measuring DFlash acceptance."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from qual.records import AcceptanceCounts
from qual.runtime.spec_decode import accept
from qual.toy.drafter import DFlashDrafter, anchor_block_mask
from qual.toy.train_draft import aux_features


@dataclass(slots=True)
class EvalStats:
    """The training-time evaluation: its acceptance counts (qual.records.AcceptanceCounts) and what else it saw."""

    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    num_requests: int = 0
    output_tokens: int = 0
    greedy_checked: int = 0  # requests also decoded plainly
    mismatches_vs_greedy: int = 0  # of those, outputs that differ (0 in exact math)

    @property
    def acceptance_rate(self) -> float:
        return self.counts.rate or 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.counts.mean_acceptance_length or 1.0

    def to_dict(self) -> dict:
        """The manifest's eval record: the counts under their one spelling, the rest, and the rates derived."""
        drafts = max(1, self.counts.drafts)
        return {"num_requests": self.num_requests, **self.counts.result_fields(), "output_tokens": self.output_tokens,
                "greedy_checked": self.greedy_checked, "mismatches_vs_greedy": self.mismatches_vs_greedy,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "per_position_rate": [round(a / drafts, 4) for a in self.counts.accepted_per_position]}


@torch.no_grad()
def draft_block(drafter: DFlashDrafter, target, seq: torch.Tensor, aux: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Draft K tokens after `seq` [1, n]: context = aux of seq[:-1], block = [seq[-1], MASK*K] at n-1.."""
    s = drafter.shape
    n, dev = seq.shape[1], seq.device
    ctx = drafter.context(aux[:, : n - 1])
    block = torch.full((1, s.block_size), mask_token_id, device=dev, dtype=torch.long)
    block[0, 0] = seq[0, -1]
    block_pos = (n - 1 + torch.arange(s.block_size, device=dev))[None]
    ctx_pos = torch.arange(n - 1, device=dev)[None]
    anchor = torch.tensor([[n - 1]], device=dev)  # the block as one training block anchored at n - 1
    masks = {"full_attention": anchor_block_mask(anchor, n - 1, s.block_size),
             "sliding_attention": anchor_block_mask(anchor, n - 1, s.block_size, s.draft_sliding_window)}
    h = drafter(ctx, ctx_pos, target.get_input_embeddings()(block), block_pos, masks)
    return drafter.propose(h[:, 1:], block[:, 0], target.get_output_embeddings())  # [1, K]


@torch.no_grad()
def speculative_greedy(target, drafter: DFlashDrafter, prompt: list[int], max_new: int, mask_token_id: int,
                       eos_token_id: int, stats: EvalStats) -> list[int]:
    """Greedy decode with DFlash drafts; updates `stats`; returns the new tokens."""
    k = drafter.shape.block_size - 1
    dev = next(target.parameters()).device
    seq = torch.tensor([prompt], device=dev)
    out = target(input_ids=seq, output_hidden_states=True)
    aux = aux_features(out.hidden_states, drafter.shape.target_layer_ids)
    seq = torch.cat([seq, out.logits[:, -1:].argmax(-1)], dim=1)  # bonus token from prefill
    while seq.shape[1] - len(prompt) < max_new and seq[0, -1].item() != eos_token_id:
        drafts = draft_block(drafter, target, seq, aux, mask_token_id)  # [1, K]
        n = seq.shape[1]
        out = target(input_ids=torch.cat([seq, drafts], dim=1), output_hidden_states=True)
        choice = out.logits[0, n - 1 :].argmax(-1)  # [K+1]: target's token after seq, after d1, ...
        accepted = accept(drafts[0].tolist(), choice[:k].tolist())
        stats.counts.record_step(accepted, k)
        new = torch.cat([drafts[0, :accepted], choice[accepted : accepted + 1]])
        if (new == eos_token_id).any():
            new = new[: int((new == eos_token_id).nonzero()[0]) + 1]
        seq = torch.cat([seq, new[None]], dim=1)
        aux = aux_features(out.hidden_states, drafter.shape.target_layer_ids)
    return seq[0, len(prompt) : len(prompt) + max_new].tolist()


@torch.no_grad()
def plain_greedy(target, prompt: list[int], max_new: int, eos_token_id: int) -> list[int]:
    dev = next(target.parameters()).device
    seq = torch.tensor([prompt], device=dev)
    for _ in range(max_new):
        nxt = target(input_ids=seq, logits_to_keep=1).logits[:, -1:].argmax(-1)
        seq = torch.cat([seq, nxt], dim=1)
        if nxt.item() == eos_token_id:
            break
    return seq[0, len(prompt) :].tolist()


def evaluate(target, drafter: DFlashDrafter, prompts: list[list[int]], max_new: int, mask_token_id: int,
             eos_token_id: int, log: Callable[[str], None], greedy_check: int = 0) -> EvalStats:
    """Acceptance over `prompts` (token ids), greedy, K = block_size - 1."""
    stats = EvalStats(AcceptanceCounts().padded(drafter.shape.block_size - 1))
    t0 = time.time()
    for i, prompt in enumerate(prompts):
        out = speculative_greedy(target, drafter, prompt, max_new, mask_token_id, eos_token_id, stats)
        stats.num_requests += 1
        stats.output_tokens += len(out)
        if i < greedy_check:
            stats.greedy_checked += 1
            stats.mismatches_vs_greedy += int(out != plain_greedy(target, prompt, max_new, eos_token_id))
        if (i + 1) % 40 == 0 or i + 1 == len(prompts):
            log(f"eval {i + 1}/{len(prompts)} rate {stats.acceptance_rate:.4f} "
                f"tau {stats.mean_acceptance_length:.3f} ({time.time() - t0:.0f}s)")
    return stats
