"""A prefill step on one rank: whole prompts through the target (the drafter's context written on the way), in
chunks of similar length, replayed from CUDA graphs where the runner has them (qual/runtime/prefill_graphs.py)."""

from __future__ import annotations

import torch

from qual.runtime import spec_decode
from qual.runtime.cache_views import StepShape, view_width
from qual.runtime.kv_cache import table_tensor
from qual.runtime.paged import write_slots
from qual.runtime.steps import PrefillStep, StepOutput


def prefill(runner, step: PrefillStep) -> StepOutput:
    """Whole prompts through the target, in length-sorted chunks so padding stays small."""
    dev = runner.to_device
    order = sorted(range(len(step.prompts)), key=lambda i: len(step.prompts[i]))
    parts, chunk = [], []  # (logits, choices) of each chunk, in length order
    for i in order + [None]:
        longest = len(step.prompts[i]) if i is not None else 0
        if chunk and (i is None or (len(chunk) + 1) * longest > runner.cfg.max_prefill_tokens):
            parts.append(_chunk(runner, step, chunk))
            chunk = []
        if i is not None:
            chunk.append(i)
    logits, choices = (None if t[0] is None else torch.cat(t) if len(t) > 1 else t[0] for t in zip(*parts))
    if order != sorted(order):  # back to the step's order
        inverse = dev(torch.tensor(sorted(range(len(order)), key=order.__getitem__)))
        logits, choices = logits[inverse], None if choices is None else choices[inverse]
    if runner.comm.rank != 0:
        return StepOutput(logits)
    # Greedy choices where the logits are: read by the host without waiting, and kept here, where a decode step
    # launched before the host has read them takes them as its last tokens (DecodeStep.first_rows)
    runner.first_tokens = choices[:, 0].long()
    return StepOutput(logits, None, runner.readback.start(choices))


def _chunk(runner, step: PrefillStep, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target logits at each prompt's last token [n, V] and rank 0's greedy choices of them (pack_choices; None on
    the other ranks)."""
    dev = runner.to_device
    prompts = [step.prompts[i] for i in idx]
    rows = {name: [t[i] for i in idx] for name, t in step.tables.items()}
    if runner.prefill_graphs is not None:
        out = runner.prefill_graphs.run(prompts, rows)
        if out is not None:
            return out
    tables = {name: dev(table_tensor(t)) for name, t in rows.items()}
    lens = [len(p) for p in prompts]
    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    positions = torch.cat([torch.arange(n) for n in lens])
    rows = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lens)])
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    q = torch.arange(max(lens))
    q_index = torch.where(q[None, :] < torch.tensor(lens)[:, None], starts[:, None] + q[None, :], torch.tensor(-1))
    seq_lens = torch.tensor(lens)
    last = starts + seq_lens - 1
    widths = {name: view_width(runner.caches.by_name[name].spec, runner.caches.geometry[name], seq_lens)
              for name in runner.caches.target_groups}
    tokens, positions, rows, q_index, seq_lens, last = (dev(t) for t in (
        tokens, positions, rows, q_index, seq_lens, last))
    shape = StepShape(positions, rows, q_index, seq_lens, torch.zeros_like(seq_lens))
    meta = runner.caches.target_meta(shape, tables, widths, prefill=True)
    hidden, aux = runner.target.forward(tokens, positions, meta, runner.caches.stores)
    if runner.drafter is not None:  # the whole prompt becomes draft context now, so decode steps stay small
        slots = {name: runner.caches.route(name, write_slots(runner.caches.geometry[name], positions, rows, tables[name]))
                 for name in runner.caches.draft_groups}
        runner.drafter.write_context(aux, positions, slots, runner.caches.stores, runner.caches.layer_slots)
    # Only rank 0 samples: the other ranks skip the LM head.
    if runner.comm.rank != 0:
        return hidden.new_zeros(len(idx), 1), None
    logits = runner.target.logits(hidden[last])
    return logits, spec_decode.pack_choices(logits[:, None], None)

