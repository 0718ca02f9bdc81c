"""CUDA graphs for the decode step (draft + verify in one graph) at fixed batch sizes.

Static input buffers per size, captured largest first into one shared memory pool after a
warm-up; a step is padded to the next captured size (pad rows see nothing and write to the
trash slot). Steps larger than every captured size run eagerly and are counted as such.
With EngineConfig.steps_per_launch = n > 1 each size also has a graph of n steps back to back
(each advancing the next one's inputs), over the same input buffers as its one-step graph: a
launch of either kind leaves the inputs advanced for the next launch of either kind. Under async
decode each of them also has a join graph: in a launch ahead, rows that requests held ready take
over get their numbers and the draft context is packed again (spec_decode.join_rows) in one replay,
where eagerly that is about sixteen small launches of the host's (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import gc
import time

import torch

from qual.runtime.config import DEFAULT_SIZES
from qual.runtime.spec_decode import join_rows
from qual.runtime.step_args import NUMBERS


class _Graph:
    """The captured decode graphs of one batch size: one step, and (steps_per_launch > 1) that many steps. Their
    static inputs, shared, are the step's StepArgs (one flat int64 buffer: the views are built from them inside the
    graph) and its draft context features."""

    def __init__(self, batch_size: int, flat: torch.Tensor, feats, stager):
        self.batch_size, self.flat, self.feats, self.stager = batch_size, flat, feats, stager
        self.runs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}  # steps -> (graph, its outputs)
        # Async decode: steps -> the join graph reading that run's aux; its input, spec_decode.join_rows' table
        self.joins: dict[int, torch.cuda.CUDAGraph] = {}
        self.join_table = torch.zeros(1 + len(NUMBERS), batch_size, dtype=torch.long, device=flat.device)
        self.last_steps: int | None = None  # the run replayed last: the one whose aux a join packs from

    def load(self, args, feats, advanced: bool = False):
        """Refill the static inputs (one host-to-device copy and one device copy); returns the step's arguments as
        views of them. advanced: the graph's last replay advanced its numbers and draft context itself (async
        decode): only the tables are sent."""
        if args.numel != self.flat.numel():
            raise ValueError(f"step arguments of {args.numel} numbers for a graph captured with {self.flat.numel()}")
        sent = self.stager.send(args, into=self.flat, tables_only=advanced)
        if feats is not None and not advanced:
            self.feats.copy_(feats, non_blocking=True)
        return sent

    def replay(self, steps: int = 1):
        """Replay the graph of `steps` steps: the last step's (logits, drafts, aux) and every step's choices
        [steps, P, W]."""
        graph, outputs = self.runs[steps]
        graph.replay()
        self.last_steps = steps
        return outputs

    def join(self, table: torch.Tensor) -> None:
        """Rows that requests held ready take over, in a launch ahead (after load, before replay): table is
        step_args.join_table's, copied in without the host waiting; the join graph of the run replayed last packs
        the draft context from that run's aux."""
        if self.last_steps not in self.joins:
            raise ValueError(f"a join at batch size {self.batch_size} without a launch of that size before it")
        self.join_table.copy_(table.pin_memory(), non_blocking=True)
        self.joins[self.last_steps].replay()

    def reset(self) -> None:
        for graph in [*(g for g, _ in self.runs.values()), *self.joins.values()]:
            graph.reset()


class DecodeGraphs:
    """Captured decode graphs of one rank, and a record of how they were used."""

    def __init__(self, runner, sizes=DEFAULT_SIZES, steps: int = 1):
        self.runner = runner
        self.sizes = sorted(set(sizes), reverse=True)
        self.steps = list(range(1, steps + 1))  # steps a launch may run: a graph of each per size
        self.graphs: dict[int, _Graph] = {}
        self.replays: dict[int, int] = {}
        self.launches: dict[int, int] = {}  # steps -> launches of that many
        self.pool = None  # the memory pool of every graph here
        self.eager_steps: dict[int, int] = {}  # batch sizes that ran without a graph
        self.seconds = 0.0
        self.bytes = 0
        self.error: str | None = None
        self.captured: list[int] = []
        self._capture()

    def _dummy_step(self, batch_size: int):
        from qual.runtime.steps import DecodeStep

        r = self.runner
        ids = [f"__graph_{i}" for i in range(batch_size)]
        Q = 1 + r.K
        if r.drafter is not None:
            width = len(r.draft_cfg.target_layer_ids) * r.draft_cfg.layers.hidden_size
            for rid in ids:
                r.pending[rid] = (torch.zeros(Q, width, dtype=r.target.dtype, device=r.comm.device), 0)
        tables = {name: [[]] * batch_size for name in r.caches.geometry}  # no blocks: every row all -1
        return DecodeStep(ids, [0] * batch_size, [2] * batch_size, [0] * batch_size, [1] * batch_size, tables), ids

    def _capture(self) -> None:
        device = self.runner.comm.device
        self._settle()
        reserved_before = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        for bs in self.sizes:  # largest first: the smaller graphs reuse its pool
            self._quiesce()
            try:
                graph = self._capture_one(bs)
            except Exception as exc:  # keep running eagerly, but say so
                self.error, graph = f"size {bs}: {type(exc).__name__}: {exc}", None
            if not self._all_ranks(graph is not None):
                self.error = self.error or f"size {bs}: capture failed on another rank"
                self.graphs.clear()  # every rank replays graphs or none does: collectives must match
                break
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.captured = sorted(self.graphs)
        self.seconds = time.perf_counter() - start
        self._settle()
        self.bytes = max(0, torch.cuda.memory_reserved(device) - reserved_before)

    @staticmethod
    def _settle() -> None:
        """Idle GPU, and the caching allocator holding only live blocks. Free device memory would also count
        what the allocator kept from an earlier engine in this process (the first arm of a run), and the warm-up
        steps' activations: so the graphs' bytes are what stays reserved across the capture (their pool and
        static buffers), the same in either arm. Unreachable objects are collected first: an earlier engine's
        tensors held in reference cycles would otherwise be freed by whichever collection runs next, perhaps in the
        middle of this capture, and lower its count."""
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _capture_one(self, bs: int) -> _Graph:
        runner = self.runner
        step, ids = self._dummy_step(bs)
        host, feats = runner.step_args(step, pad_to=bs, static=True)
        for rid in ids:
            runner.pending.pop(rid, None)
        flat = torch.empty(host.numel, dtype=torch.long, device=runner.comm.device)
        args = runner.stager.send(host, into=flat)
        runner.rows(bs)  # made outside the capture (and outside a compiled function's first trace)
        made = _Graph(bs, flat, feats, runner.stager)
        # With peers, c10d's NCCL watchdog thread queries events while we capture;
        # "thread_local" keeps other threads' calls from invalidating this capture.
        mode = "thread_local" if runner.comm.tp_size > 1 else "global"
        for n in self.steps:
            def run(n=n):  # the views from the arguments, draft + verify, and (async decode) the next step's inputs
                return runner.static_run(args, feats, n)

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2 if n == 1 else 1):  # warm-up: allocator, cuBLAS handles, NCCL communicators
                    run()
            torch.cuda.current_stream().wait_stream(stream)
            runner.stager.send(host, into=flat)  # the dummy numbers again: async decode advanced them
            self._quiesce()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=mode):
                out = run()
            self.pool = graph.pool() if self.pool is None else self.pool  # every graph in the first one's pool
            made.runs[n] = (graph, out)
            # A graph's first launch also uploads it: that belongs to the capture, not to the first step that needs
            # this graph (steps_per_launch > 1 may first need a size's 3-step graph in the middle of a generate).
            # The dummy step writes only the trash slots; its advanced numbers are put back.
            graph.replay()
            runner.stager.send(host, into=flat)
        if runner.async_decode:  # rows are taken over in launches ahead only
            for n, (_, out) in made.runs.items():
                made.joins[n] = self._capture_join(made, args.numbers, out[2], mode)
        return made

    def _capture_join(self, made: _Graph, numbers: torch.Tensor, aux: torch.Tensor | None, mode: str):
        """The join graph of one run: spec_decode.join_rows over the size's static numbers, draft context and that
        run's aux output. Its table is all zeros here, so the warm-up changes no number."""
        q = 1 + self.runner.K

        def run():
            join_rows(numbers, made.join_table, made.feats, aux, q)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm-up: the kernels' first launches, the allocator
        torch.cuda.current_stream().wait_stream(stream)
        self._quiesce()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=mode):
            run()
        return graph

    def _quiesce(self) -> None:
        """All ranks at the same point with no GPU or NCCL work in flight."""
        torch.cuda.synchronize()
        comm = self.runner.comm
        if comm.tp_size > 1:
            torch.distributed.barrier(group=comm.tp_group, device_ids=[comm.device.index])
            torch.cuda.synchronize()

    def _all_ranks(self, ok: bool) -> bool:
        """Whether ok holds on every rank (an all-reduce outside any capture)."""
        comm = self.runner.comm
        if comm.tp_size == 1:
            return ok
        flag = torch.tensor([1.0 if ok else 0.0], device=comm.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=comm.tp_group)
        return flag.item() == 1.0

    def release(self) -> None:
        """Free every graph. Must come before the process group is destroyed: a live graph that holds
        NCCL kernels makes destroy_process_group hang (2 x H200, torch 2.11, NCCL 2.28)."""
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        torch.cuda.synchronize()

    def fit(self, batch_size: int) -> int | None:
        """The smallest captured size that holds batch_size requests."""
        return min((s for s in self.graphs if s >= batch_size), default=None)

    def holds(self, batch_size: int) -> bool:
        """Whether a captured graph holds batch_size requests (nothing counted)."""
        return self.fit(batch_size) is not None

    def for_batch(self, batch_size: int, steps: int = 1) -> _Graph | None:
        """The smallest captured graphs that hold batch_size requests (None: run eagerly), counted as a launch of
        `steps` steps."""
        size = self.fit(batch_size)
        if size is None:
            self.eager_steps[batch_size] = self.eager_steps.get(batch_size, 0) + 1
            return None
        if steps not in self.steps:
            raise ValueError(f"a launch of {steps} decode steps; graphs were captured for {self.steps}")
        g = self.graphs[size]
        self.replays[g.batch_size] = self.replays.get(g.batch_size, 0) + 1
        self.launches[steps] = self.launches.get(steps, 0) + 1
        return g

    def record(self) -> dict:
        """The capture record for result.json graph_capture."""
        captured = self.captured
        return {
            "status": "captured" if captured else "failed",
            "mode": "FULL_DECODE_ONLY",
            "sizes": captured,
            "seconds": round(self.seconds, 3),
            "bytes": self.bytes,
            "replays": {str(k): v for k, v in sorted(self.replays.items())},  # launches, by batch size
            # launches by the decode steps each ran (EngineConfig.steps_per_launch), and the step counts captured
            "steps_per_launch": self.steps,
            "launches_by_steps": {str(k): v for k, v in sorted(self.launches.items())},
            "eager_steps": {str(k): v for k, v in sorted(self.eager_steps.items())},
            # A size we captured must never have run eagerly; steps above the largest size do, visibly.
            "eager_fallback_sizes": sorted(b for b in self.eager_steps if b in captured),
            "detail": self.error,
        }


def capture_record(runner) -> dict:
    """A runner's CUDA-graph record: its decode graphs, prefill graphs and kernel backend (every rank captures the
    same sizes in lock-step, so rank 0's stands for all)."""
    backend = runner.backend.record()
    prefill = runner.prefill_graphs.record() if runner.prefill_graphs else None
    if runner.graphs is None:
        why = "CUDA graphs need a CUDA device" if runner.cfg.device == "cpu" else "CUDA graphs disabled (no capture sizes)"
        return {"status": "unsupported", "mode": None, "sizes": [], "seconds": None, "bytes": None, "detail": why,
                "backend": backend, "prefill": prefill}
    record = {**runner.graphs.record(), "backend": backend, "prefill": prefill}
    if prefill and prefill["status"] == "captured":  # prefill chunks replayed from graphs too, not decode only
        record["mode"] = "FULL"
    return record
