"""Small prefill chunks at padded, bucketed shapes, replayed from CUDA graphs.

Why: eagerly, a prompt's prefill through a small target and its drafter is a few hundred operators, each launched
by the host, and on a GPU that host work can take as long as the decode steps after it; replayed from a graph it
is one launch.

A chunk of n prompts, the longest L tokens long, runs as a rectangle of P x L' tokens: P = n rounded up to a power
of two, L' = L rounded up to a quarter of the power of two below it (a multiple of MIN_LENGTH up to 64), so a few
shapes serve every chunk and, past 64 tokens, at most a fifth of a row is padding. Row r holds prompt r and
padding after it; padding is never written to a cache (its write slots are the trash slot) and its outputs are
dropped, so the real tokens compute what the eager prefill computes (tests/test_prefill_graphs.py). Every row has
L' query tokens in order, so the attention needs no un-padding (`TargetMeta.dense`) and no step syncs the host.

A bucket is captured the first time a chunk needs it (that chunk runs eagerly on a side stream as the capture's
warm-up, then replays the captured graph, whose first launch also uploads it); later chunks of the bucket replay
it. A failed capture leaves later chunks eager, and the record says so. Chunks above
`EngineConfig.prefill_graph_tokens` padded tokens run eagerly, counted; so does every chunk where the layout cannot
be padded this way (cache groups other than paged K/V: a recurrent state would read the padding) or the graphs
are off (tp > 1, or no decode graphs). On the CPU, `static_shapes` runs the same padded function eagerly, so the
CPU tests cover what the graphs capture.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from qual.runtime.cache_views import StepShape, build_view, view_geometry
from qual.runtime.geometry import blocks_needed
from qual.runtime.models.base import TargetMeta
from qual.runtime.paged import KeyIndex, write_slots
from qual.runtime.spec_decode import pack_choices

MIN_LENGTH = 16  # shortest padded prompt length, and the step of padded lengths up to 64


def bucket(num_prompts: int, longest: int) -> tuple[int, int]:
    """(rows, padded length) of a chunk of num_prompts prompts, the longest `longest` tokens: rows a power of two,
    the length rounded up to a quarter of the power of two below it (80, 96, 112, 128, 160, ...; MIN_LENGTH steps up
    to 64), so that a few captures serve every chunk. Why not a power of two: every token of the rectangle costs
    prefill time, and the first 64 HumanEval prompts in chunks of 8 (longest 40 to 282 tokens) filled 39% of 8 x 256
    rectangles; quarter steps cut a row's padding past 64 tokens to at most a fifth of it."""
    step = max(MIN_LENGTH, (1 << (max(longest, 1) - 1).bit_length()) // 8)
    return 1 << (num_prompts - 1).bit_length(), -(-max(longest, 1) // step) * step


@dataclass
class _Bucket:
    """One padded shape: its static input buffer (tokens [P*L], lengths [P], then each group's table [P, W] in
    sorted group order), the key indices of its width, and, once captured, the graph and its output."""

    rows: int
    length: int
    widths: dict[str, int]  # block-table columns per group
    flat: torch.Tensor
    index: dict[str, KeyIndex]
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, torch.Tensor] | None = None  # the graph's (logits, choices)

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        P, L = self.rows, self.length
        tokens, lens = self.flat[: P * L], self.flat[P * L : P * L + P]
        tables, at = {}, P * L + P
        for name in sorted(self.widths):
            n = P * self.widths[name]
            tables[name] = self.flat[at : at + n].view(P, self.widths[name])
            at += n
        return tokens, lens, tables


class PrefillGraphs:
    """The padded prefill of one rank, and its record."""

    def __init__(self, runner, max_tokens: int, capture: bool):
        self.runner = runner
        self.max_tokens = max_tokens
        self.capture = capture  # CUDA: capture graphs; else run the padded function eagerly (static_shapes on CPU)
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.padded_chunks = 0  # chunks run at a bucket's shapes (captured, replayed, or eagerly under static_shapes)
        self.replays = 0
        self.eager_chunks = 0  # chunks above max_tokens: the eager prefill
        self.seconds = 0.0
        self.pool = None
        self.reason = unsupported(runner)  # why chunks run eagerly (None: they need not)
        self.failed = False  # a capture failed: every chunk after it runs eagerly
        # The padded prefill, compiled where the backend asks (compiled-prefill): before a bucket is captured, its
        # warm-up compiles it, once for the first bucket and again as rows and length turn symbolic (automatic
        # dynamic shapes: about four compiles in all, one-row buckets apart), not once a bucket
        self.compiled = runner.backend.compile_prefill and self.reason is None  # the record's word for it
        self.compute = runner.backend.compile(self._compute, dynamic=None) if self.compiled else self._compute

    @property
    def active(self) -> bool:
        return self.reason is None and self.max_tokens > 0

    def run(self, prompts: list[list[int]], tables: dict[str, list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Target logits at each prompt's last token [n, V] and their greedy choices (spec_decode.pack_choices), the
        draft context written; or None: the chunk runs eagerly (larger than max_tokens padded tokens, a layout that
        cannot be padded, or a failed capture)."""
        P, L = bucket(len(prompts), max(map(len, prompts)))
        if not self.active or P * L > self.max_tokens:
            self.eager_chunks += 1
            return None
        b = self.buckets.get((P, L)) or self._bucket(P, L)
        n = len(prompts)
        # From page-locked memory without blocking: a copy from pageable memory would wait for the device
        host = self._host_inputs(b, prompts, tables)
        b.flat.copy_(host.pin_memory() if b.flat.is_cuda else host, non_blocking=True)
        if not self.capture:
            out = self.compute(b)
        elif b.graph is None:
            try:
                out = self._capture(b)
            except Exception as exc:  # e.g. out of memory: prefill goes on eagerly, and the record says why
                self.reason, self.failed = f"capture of bucket {P}x{L} failed: {type(exc).__name__}: {exc}", True
                self.eager_chunks += 1
                return None
        else:
            b.graph.replay()
            self.replays += 1
            out = b.outputs
        self.padded_chunks += 1
        # A graph's outputs are overwritten by its next replay, and another bucket's may reuse their memory (one
        # pool): the caller's own copies
        logits, choices = out
        return logits[:n].clone(), choices[:n].clone()

    def _bucket(self, P: int, L: int) -> _Bucket:
        r = self.runner
        dev = r.comm.device
        widths = {name: blocks_needed(L, r.cfg.cache.block_size, 1) for name in r.caches.geometry}
        index = {name: KeyIndex.build(view_geometry(r.caches.by_name[name].spec, r.caches.geometry[name]), L, widths[name], dev)
                 for name in r.caches.target_groups}  # the target's key views (the drafter's context is only written)
        size = P * L + P + sum(P * w for w in widths.values())
        b = self.buckets[(P, L)] = _Bucket(P, L, widths, torch.empty(size, dtype=torch.long, device=dev), index)
        return b

    @staticmethod
    def _host_inputs(b: _Bucket, prompts: list[list[int]], tables: dict[str, list[list[int]]]) -> torch.Tensor:
        """The chunk in the bucket's layout: padding tokens 0, padding rows of length 0, each request's block ids cut
        or padded with -1 to the bucket's width (columns past the padded length hold nothing a prompt reaches). Built
        as one list and converted once: a torch operator per part costs more host time, which on a GPU is on the
        critical path before the prefill's launch."""
        P, L = b.rows, b.length
        flat = []
        for p in prompts:
            flat += p + [0] * (L - len(p))
        flat += [0] * (L * (P - len(prompts)))
        flat += [len(p) for p in prompts] + [0] * (P - len(prompts))
        for name in sorted(b.widths):
            w = b.widths[name]
            for row in tables[name]:
                flat += row[:w] + [-1] * (w - len(row))
            flat += [-1] * (w * (P - len(prompts)))
        return torch.tensor(flat, dtype=torch.long)

    def _compute(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded prefill from the bucket's inputs: target forward, draft context, logits at each row's last
        token [P, V] and their greedy choices [P, 2] (in the graph, where their dozen small kernels cost the host
        nothing). What a graph captures: device work only, shapes fixed by the bucket."""
        r = self.runner
        P, L = b.rows, b.length
        tokens, lens, tables = b.inputs()
        flat = torch.arange(P * L, device=tokens.device)
        positions, rows = flat % L, flat // L
        real = positions < lens[rows]  # padding tokens are written to no cache
        shape = StepShape(positions, rows, flat.view(P, L), lens, torch.zeros_like(lens))
        views = {}
        for name in r.caches.target_groups:
            g = r.caches.by_name[name]
            views[name] = build_view(g.spec, r.caches.geometry[name], shape, tables[name],
                                     lambda slots, n=name: r.caches.route(n, torch.where(real, slots, -1)), L, b.index[name])
        hidden, aux = r.target.forward(tokens, positions, TargetMeta(shape.q_index, views, dense=True, prefill=True),
                                       r.caches.stores)
        if r.drafter is not None:
            slots = {name: write_slots(r.caches.geometry[name], positions, rows, tables[name]) for name in r.caches.draft_groups}
            slots = {name: r.caches.route(name, torch.where(real, w, -1)) for name, w in slots.items()}
            r.drafter.write_context(aux, positions, slots, r.caches.stores, r.caches.layer_slots)
        last = torch.arange(P, device=tokens.device) * L + (lens - 1).clamp(min=0)
        logits = r.target.logits(hidden[last])
        return logits, pack_choices(logits[:, None], None)

    def _capture(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """Warm up on a side stream (the chunk run eagerly), capture the bucket, then replay it once for the chunk's
        result: a graph's first launch also uploads it to the device, which belongs to the capture, not to the next
        chunk of this bucket. The replay writes what the warm-up wrote (same inputs, same cache slots), so running
        the chunk twice changes nothing."""
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.compute(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            b.outputs = self.compute(b)
        graph.replay()
        b.graph = graph
        self.seconds += time.perf_counter() - start
        return b.outputs

    def release(self) -> None:
        """The graphs, and the references back to the runner (the bound compute among them)."""
        for b in self.buckets.values():
            if b.graph is not None:
                b.graph.reset()
        self.buckets.clear()
        self.compute = self.runner = None

    def record(self) -> dict:
        """What the capture record says of prefill: the buckets captured, replays, chunks that ran eagerly."""
        captured = sorted(k for k, b in self.buckets.items() if b.graph is not None)
        status = ("failed" if self.failed else "unsupported" if self.reason else "off" if self.max_tokens == 0 else
                  "captured" if captured else "not_captured")  # not_captured: eager at padded shapes, or no chunk fit
        return {"status": status, "max_tokens": self.max_tokens, "buckets": [f"{p}x{n}" for p, n in captured],
                "padded_chunks": self.padded_chunks, "replays": self.replays, "eager_chunks": self.eager_chunks,
                "seconds": round(self.seconds, 3), "compiled": self.compiled, "detail": self.reason}


def unsupported(runner) -> str | None:
    """Why this rank's prefill cannot run at padded shapes (None: it can)."""
    if runner.comm.tp_size > 1:
        return "prefill graphs run on one rank (tp 1)"
    kinds = sorted({g.spec.kind for g in runner.caches.groups} - {"gqa"})
    if kinds:  # a recurrent state or a pooled / ring cache would take the padding in
        return f"prefill graphs need paged K/V caches only (this pair has {', '.join(kinds)})"
    return None
