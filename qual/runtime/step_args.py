"""A decode step's per-request numbers, the only host-built input of the step, and their trip to the device.

Every slot, key view and mask of a decode step is a function of a few integers per request (last token, committed
length, sequence length, accepted count, draft context length) and the block tables. The host builds just those
([P]-sized, plus the tables [P, blocks]); the views are built from them where they land (model_runner's
`build_inputs`), on the device inside the CUDA graph for graph steps. The host's work per step is then O(P), not
O(P * key width), and the numbers cross in one copy from page-locked memory.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from qual.runtime.steps import DecodeStep

# The [P] rows of StepArgs.numbers, in order.
NUMBERS = ("last_tokens", "num_committed", "seq_lens", "commit_counts", "ctx_len")


@dataclass
class StepArgs:
    """numbers [5, P] int64 (NUMBERS), tables {group: [P, blocks]} int64; num_ctx: draft context rows (static: P*Q)."""

    numbers: torch.Tensor
    tables: dict[str, torch.Tensor]
    num_ctx: int
    # The one buffer all of them are views of, in leaves() order (pack's and flat_views'): what travels, in one copy
    flat: torch.Tensor | None = None

    def number(self, name: str) -> torch.Tensor:
        """One row of numbers, [P]."""
        return self.numbers[NUMBERS.index(name)]

    def leaves(self) -> list[torch.Tensor]:
        """The tensors in a fixed order: numbers, then the tables by group name."""
        return [self.numbers] + [self.tables[k] for k in sorted(self.tables)]

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.leaves())


def decode_args(step: DecodeStep, P: int, K: int, widths: dict[str, int], static: bool) -> StepArgs:
    """A decode step's StepArgs on the host, padded to P rows (pad rows: last token 0, committed 1, nothing else) and
    to widths (pack); static: P * (1 + K) draft context rows (a CUDA graph's), else the step's own count."""
    pad = [0] * (P - len(step.req_ids))
    numbers = [
        step.last_tokens + pad,
        step.num_committed + [1] * len(pad),
        [n + K for n in step.num_committed] + pad,  # sequence length once this step's tokens are in
        step.commit_counts + pad,
        step.ctx_len + pad,
    ]
    return pack(numbers, step.tables, P, widths, P * (1 + K) if static else sum(step.commit_counts))


def pack(numbers: list[list[int]], tables: dict[str, list[list[int]]], rows: int, widths: dict[str, int],
         num_ctx: int) -> StepArgs:
    """A step's StepArgs from host lists, as views of one int64 host tensor in leaves() order: numbers [5, rows]
    (NUMBERS, each row padded by the caller), then each group's block ids padded with -1 to [rows, width], width the
    group's entry in widths or its longest row if longer (at least 1). One conversion of one flat list: a tensor
    from each nested list cost several times as much host time (25 us for 8 x 24 block ids, 8 us through an array,
    on the 2-core development CPU), every decode launch."""
    flat = [x for row in numbers for x in row]
    shapes = {}
    for name in sorted(tables):
        width = max(widths.get(name, 0), max((len(r) for r in tables[name]), default=0), 1)
        shapes[name] = (rows, width)
        for r in tables[name]:
            flat += r
            flat += [-1] * (width - len(r))
        flat += [-1] * (width * (rows - len(tables[name])))
    host = torch.frombuffer(array("q", flat), dtype=torch.long)  # shares the array's memory, which it keeps alive
    return _views(host, (len(numbers), rows), shapes, num_ctx)


def context_rows(counts: torch.Tensor, ctx_len: torch.Tensor, num_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position and request row of each of num_ctx draft context rows: request i's counts[i] accepted tokens, at
    positions ctx_len[i].., packed request after request; rows past the total are padding (position 0, row -1).

    Row r belongs to the request whose running count first exceeds r: a search, not a host loop, so that it runs
    on the device inside a graph.
    """
    rows, offset = context_sources(counts, num_ctx)
    real = rows >= 0
    return torch.where(real, ctx_len[rows.clamp(min=0)] + offset, 0), rows


def context_sources(counts: torch.Tensor, num_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of num_ctx packed context rows: its request (-1: padding) and its index among that request's
    counts[i] tokens. Row r belongs to the request whose running count first exceeds r."""
    ends = counts.cumsum(0)
    r = torch.arange(num_ctx, device=counts.device)
    owner = torch.searchsorted(ends, r, right=True)
    real = owner < counts.shape[0]
    owner = owner.clamp(max=counts.shape[0] - 1)
    return torch.where(real, owner, -1), torch.where(real, r - (ends - counts)[owner], 0)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on device without the host waiting for it: on CUDA a copy from pageable memory waits for
    every kernel queued before it (the prefill graph just launched, say), so it goes through page-locked memory
    without blocking (torch's page-locked cache keeps the buffer until the copy has run)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def join_table(rows: list[int], host: torch.Tensor) -> torch.Tensor:
    """[1 + 5, P] int64 on the host for spec_decode.join_rows: a row of flags (1: a request held ready takes this row
    over), then the step's numbers as the host built them (host [5, P], NUMBERS) on those rows, zeros elsewhere."""
    table = torch.zeros(1 + host.shape[0], host.shape[1], dtype=torch.long)
    table[0, rows] = 1
    table[1:, rows] = host[:, rows]
    return table


def retire(numbers: torch.Tensor, rows: list[int]) -> None:
    """Make rows of a step's numbers [5, P] on the device padding: sequence length 0. Their other numbers stay, so
    that the draft context the device packed for this step (by commit_counts) still lines up; the next advance
    then commits nothing for them (spec_decode.advance). A fill a row (the rows finished since the last launch,
    one or two): on a GPU one kernel each, where an index tensor would cost a page-locked buffer and its copy first."""
    seq_lens = NUMBERS.index("seq_lens")
    for r in rows:
        numbers[seq_lens, r] = 0


def flat_views(flat: torch.Tensor, like: StepArgs) -> StepArgs:
    """A StepArgs of like's shapes whose tensors are views of the int64 buffer flat (leaves() order)."""
    return _views(flat, like.numbers.shape, {name: like.tables[name].shape for name in sorted(like.tables)}, like.num_ctx)


def _views(flat: torch.Tensor, numbers: tuple, tables: dict[str, tuple], num_ctx: int) -> StepArgs:
    """StepArgs of these shapes as views of flat (contiguous): numbers first, then the tables in the (sorted) order
    given. One as_strided a view: half the host time of a slice and a view, every decode launch."""
    base = flat.storage_offset()
    at = numbers[0] * numbers[1]
    views = {}
    for name, (r, w) in tables.items():
        views[name] = flat.as_strided((r, w), (w, 1), base + at)
        at += r * w
    return StepArgs(flat.as_strided(tuple(numbers), (numbers[1], 1), base), views, num_ctx, flat)


class Stager:
    """StepArgs to the device in one host-to-device copy.

    On CUDA the host packs the leaves into a page-locked buffer and copies it without blocking. Before the buffer
    is packed again the host waits for the event of its last copy: a step's copy may not have left yet when the
    host builds the next (the prefill between two decode steps never waits on the device). On the CPU the
    arguments already are where the step reads them.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._event = torch.cuda.Event() if self.cuda else None
        self._pending = False

    def send(self, args: StepArgs, into: torch.Tensor | None = None, tables_only: bool = False) -> StepArgs:
        """args on the device: in `into` (an int64 device buffer of args.numel, a graph's static inputs) or a new one.

        tables_only: refill only the tables of `into`; its numbers stay as the device advanced them (async decode).
        """
        skip = args.numbers.numel() if tables_only else 0
        n = args.numel - skip
        if not self.cuda:
            if into is None:
                return args
            _gather(args, skip, into[skip:])
            return flat_views(into, args)
        if self._pending:
            self._event.synchronize()  # the last copy out of the page-locked buffer has finished
        if self._host is None or self._host.numel() < n:
            self._host = torch.empty(max(n, 2 * (0 if self._host is None else self._host.numel()), 1024),
                                     dtype=torch.long, pin_memory=True)
        host = self._host[:n]
        _gather(args, skip, host)
        flat = into if into is not None else torch.empty(args.numel, dtype=torch.long, device=self.device)
        flat[skip:].copy_(host, non_blocking=True)
        self._event.record()
        self._pending = True
        return flat_views(flat, args)


def _gather(args: StepArgs, skip: int, out: torch.Tensor) -> None:
    """args' leaves from the skip-th number on, flat into out: one copy from the buffer they view (pack's), else
    one concatenation."""
    if args.flat is not None and args.flat.numel() == args.numel:
        out.copy_(args.flat[skip:])
    else:
        leaves = args.leaves()[1:] if skip else args.leaves()  # skip: the numbers, leaves()[0], whole
        torch.cat([t.reshape(-1) for t in leaves], out=out)


class Readback:
    """A step's packed choices on the host without waiting for them: a copy into one of three page-locked buffers,
    started when the step is launched and waited for when its results are read. Three, because with async decode
    the next launch's copy starts before this one's is read, and a prefill of requests held ready
    (EngineConfig.prefill_ahead) may go out between the two (a graph's outputs are overwritten by its next replay,
    hence the copy). On the CPU the step is done when it returns, and its outputs are its own: nothing to copy."""

    SLOTS = 3

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._slots: list[list] = [[None, torch.cuda.Event() if self.cuda else None] for _ in range(self.SLOTS)]
        self._next = 0

    def start(self, t: torch.Tensor) -> "PendingReadback":
        if not self.cuda:
            return PendingReadback(t, None)
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.SLOTS
        slot[1].synchronize()  # the copy three starts back was read before this slot is written again
        if slot[0] is None or slot[0].numel() < t.numel():
            slot[0] = torch.empty(max(t.numel(), 4096), dtype=t.dtype, pin_memory=True)
        host = slot[0][: t.numel()].view(t.shape)
        host.copy_(t, non_blocking=True)
        slot[1].record()
        return PendingReadback(host, slot[1])


@dataclass
class PendingReadback:
    """A readback under way: wait() gives the host tensor once its copy is done (valid until three more start)."""

    host: torch.Tensor
    event: object

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host
