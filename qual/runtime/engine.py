"""Driver (rank 0): the generation loop. A request is admitted and prefilled, then each decode launch is scheduled
(qual/runtime/scheduler.py), run by every rank (draft + verify: qual/runtime/model_runner.py, spec_decode.py) and
read back and committed here: acceptance, tokens, the next step's draft context. Ranks 1 .. N - 1 are processes
(qual/runtime/ranks.py)."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

from qual.errors import EngineError, QualError
from qual.records import RequestResult
from qual.runtime import heap
from qual.runtime.config import EngineConfig, SamplingParams
from qual.runtime.cuda_graphs import capture_record
from qual.runtime.decode_runs import DecodeRuns
from qual.runtime.kv_cache import CacheManager
from qual.runtime.model_runner import ModelRunner
from qual.runtime.parallel import Comm, arm_hang_dump, init_comm, set_cpu_threads
from qual.runtime.phases import OFF, PhaseTimer
from qual.runtime.ranks import Ranks
from qual.runtime.registry import target_spec, validate  # noqa: F401  (target_spec: the engines' notes)
from qual.runtime.scheduler import StepTally, admit, chains_prefill, reach
from qual.runtime.sequence import GenerationRequest, Sequence
from qual.runtime.spec_decode import choose, unpack_choices
from qual.runtime.steps import PrefillStep
from qual.stop_signals import check_stopping

__all__ = ["GenerationRequest", "LLMEngine", "validate"]


class LLMEngine(DecodeRuns):
    """Target + optional DFlash drafter on tp ranks (rank 0 in this process)."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self._heap_frozen = False  # heap.engine_started() counted this engine (abort may run before it did)
        specs = validate(cfg)
        self.target_cfg = specs[0].config
        self.comm: Comm | None = None
        self._prev_threads = torch.get_num_threads()
        self.ranks = Ranks(cfg)
        try:
            self._start(specs)
        except BaseException as exc:  # an interrupt too: no rank may outlive a failed start
            self.abort()
            if isinstance(exc, (QualError, EngineError)) or not isinstance(exc, Exception):
                raise
            check_stopping()  # or a stop signal's KeyboardInterrupt came back as this error (qual/stop_signals.py)
            raise EngineError(f"engine start failed: {exc}") from exc
        self.K = self.runner.K
        self.phases = self.runner.phases = PhaseTimer() if cfg.phase_times else OFF
        self.async_decode = self.runner.async_decode  # greedy steps launched ahead (_decode)
        self.steps_per_launch = self.runner.steps_per_launch  # the most decode steps one launch runs
        self.steps_ahead = 0  # decode steps launched before the last one's results were read
        self.rows_retired = 0  # rows of finished requests run as padding so that a run of steps ahead went on
        self.rows_joined = 0  # rows a request held ready took over inside a run of steps ahead (_join)
        self.tables_kept = 0  # launches ahead that left the block tables on the device as the launch before sent them
        self.launches: dict[int, int] = {}  # decode launches by the steps each ran
        self._decoding_since = 0.0  # when the run of decode steps in progress began (rank 0's perf_counter)
        self.tally = StepTally(self.K)  # verify steps so far: the tokens a step commits, for steps_to_launch
        # Tokens written past the committed length: the verify blocks of a launch, and with async decode those of
        # the launch in flight before it.
        lookahead = (self.K + 1) * (2 * self.steps_per_launch if self.async_decode else 1)
        # Tokens a request's reservation holds past prompt + max_tokens: a verify block, and under async decode what
        # a launch ahead of the one in flight writes (scheduler.reach)
        n = self.steps_per_launch
        self.tail = reach(n, n, self.K) if self.async_decode else self.K + 1
        self.cache = CacheManager(self.runner.caches.groups, cfg.cache.block_size, cfg.parallel.dcp, cfg.cache.memory_bytes,
                                  lookahead, cfg.max_model_len, cfg.parallel.admission_dcp)
        self._finished_ids: list[str] = []
        eos = self.target_cfg.eos_token_id  # an id, several (a tuple), or None: greedy runs to max_tokens
        self.eos = frozenset(eos if isinstance(eos, (tuple, list)) else ([] if eos is None else [eos]))
        heap.engine_started()  # the host loop's pauses: qual/runtime/heap.py
        self._heap_frozen = True

    @property
    def workers(self) -> list:
        """The processes of ranks 1 .. N - 1."""
        return self.ranks.workers

    def _start(self, specs: tuple) -> None:
        cfg, world = self.cfg, self.cfg.parallel.world_size
        self.ranks.start(specs)
        if world > 1:
            arm_hang_dump()
        if cfg.device == "cpu":
            set_cpu_threads(world, cfg.threads_per_rank)
        self.ranks.wait_ready()
        self.comm = init_comm(0, cfg.parallel, self.ranks.rendezvous.init_method, cfg.device, cfg.dist_timeout_s)
        self.runner = ModelRunner(cfg, self.comm, *specs)

    # -- lifecycle -------------------------------------------------------
    def close(self) -> None:
        """Stop the ranks in step with rank 0 (they must all be between steps), then release everything."""
        try:
            if self.comm is not None:
                self.ranks.stop(self.comm, self.runner)
                self.comm = None
        finally:
            self.abort()  # whatever did not stop in time; then the rendezvous and threads

    def abort(self) -> None:
        """Kill the ranks and release this process's side without one more collective (after an interrupt or a
        failure the ranks may be inside a step's collectives: a "stop" broadcast would meet an all-reduce)."""
        comm, self.comm = self.comm, None
        self.ranks.abort(comm)
        torch.set_num_threads(self._prev_threads)
        if self._heap_frozen:
            self._heap_frozen = False
            heap.engine_closed()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:  # the ranks may be anywhere in a step
            self.abort()

    def graph_capture(self) -> dict:
        """Rank 0's CUDA-graph record (every rank captures the same sizes in lock-step)."""
        return capture_record(self.runner)

    def model_facts(self) -> dict:
        """What the run should record about the checkpoints beyond their paths (e.g. a vision tower not loaded)."""
        facts = {"target": type(self.target_cfg).__name__}
        if getattr(self.target_cfg, "vision_skipped", False):
            facts["vision_tower"] = "skipped: the target's vision tower is not loaded (text-only replay)"
        return facts

    def decode_record(self) -> dict:
        """Whether async decode was taken (EngineConfig.async_decode asks; the runner decides), how many decode steps
        ran ahead of the last one's readback and how many finished requests' rows ran on as padding meanwhile, the
        steps a launch may run (EngineConfig.steps_per_launch where async decode is taken, else 1) and the launches
        by the steps each ran, over this engine's life."""
        return {"async": self.async_decode, "steps_ahead": self.steps_ahead, "rows_retired": self.rows_retired,
                "steps_per_launch": self.steps_per_launch, "launches": {str(k): v for k, v in sorted(self.launches.items())}}

    def phase_times(self) -> dict | None:
        """Rank 0's host time by phase over the last generate call (qual/runtime/phases.py); None when off."""
        return self.phases.record()

    def memory(self) -> dict:
        """Per-rank KV bytes by cache group (block pool and live use)."""
        return self.cache.memory()

    # -- generation ------------------------------------------------------
    def prompt_logits(self, prompts: list[list[int]]) -> torch.Tensor:
        """Target logits at each prompt's last position, [R, vocab] (nothing is generated)."""
        ids = [f"__prompt_logits_{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            self.cache.admit(rid, len(p))
            self.cache.ensure(rid, len(p))
        out = self._step(PrefillStep(ids, [list(p) for p in prompts], self._rows(ids)))
        for rid in ids:
            self.cache.free(rid)
        self._finished_ids.extend(ids)
        return out.logits.cpu()  # in the engine's dtype: float64 comparisons stay float64

    def _step(self, step):
        step.finished, self._finished_ids = self._finished_ids, []
        try:
            self.comm.broadcast_object(step)
            self.phases.lap("send")
            return self.runner.execute(step)
        except RuntimeError as exc:
            check_stopping()  # or a stop signal's KeyboardInterrupt came back as this error
            raise EngineError(f"a rank failed during a step: {exc}") from exc

    def _rows(self, ids: list[str]) -> dict[str, list[list[int]]]:
        return {name: self.cache.block_rows(name, ids) for name in self.cache.groups}

    def generate(
        self,
        requests: list[GenerationRequest],
        sampling: SamplingParams,
        on_result: Callable[[RequestResult], None] | None = None,
    ) -> list[RequestResult]:
        """Run every request to completion; results in input order (on_result as each finishes)."""
        arrival = time.perf_counter()  # every request is handed to the engine now (offline: all at once)
        seqs = [Sequence(r, r.max_tokens or sampling.max_tokens, self.K, arrival=arrival) for r in requests]
        for s in seqs:
            if not s.prompt_len:
                raise QualError(f"request {s.req.id}: empty prompt")
            if s.reserved_len + self.K + 1 > self.cfg.max_model_len:
                raise QualError(f"request {s.req.id}: prompt {s.prompt_len} + max_tokens {s.max_tokens} exceeds "
                                f"max_model_len {self.cfg.max_model_len}")
        done: dict[str, RequestResult] = {}
        waiting, running = deque(seqs), []
        ready: deque[Sequence] = deque()  # prefilled ahead (EngineConfig.prefill_ahead): first token read, no row yet
        self.phases.reset()

        def finish(s: Sequence) -> None:
            self.cache.free(s.req.id)
            self._finished_ids.append(s.req.id)
            done[s.req.id] = res = s.result()
            if on_result:
                on_result(res)

        while waiting or ready or running:
            joining = [ready.popleft() for _ in range(min(len(ready), self.cfg.max_num_seqs - len(running)))]
            running.extend(joining)
            # Rows still free after those are prefilled now, and with prefill_ahead the next waiting requests in the
            # same prefill (a batch's worth at most), held ready: the rows that free up next take them without a
            # prefill launch each.
            seats = self.cfg.max_num_seqs - len(running)  # the admitted beyond these are held ready
            ahead = min(self.cfg.prefill_ahead, self.cfg.max_num_seqs - seats) if seats and not ready else 0
            admitted = admit(waiting, len(running), self.cache, self.cfg.max_num_seqs, self.cfg.max_prefill_tokens,
                             self.tail, ahead)
            self.phases.lap("schedule")
            if not admitted and not running:
                raise QualError(f"request {waiting[0].req.id} does not fit the KV cache budget ({self.cfg.cache.memory_bytes} B per rank)")
            chained = None
            if admitted:
                out = self._send_prefill(admitted)
                seated, held = admitted[:seats], admitted[seats:]
                batch = len(running) + len(seated)
                if chains_prefill(batch, seated, sampling.temperature == 0, self.runner.can_launch_ahead(batch),
                                  bool(waiting or held), self.cfg.max_num_seqs):
                    chained = (admitted, out)  # committed once the first decode step is launched behind it
                    running.extend(seated)
                    ready.extend(held)  # read with the seated ones; one finished by its first token goes below
                else:
                    self._commit_prefill(admitted, out, sampling)
                    for i, s in enumerate(admitted):
                        (finish if s.finish_reason else (running if i < seats else ready).append)(s)
                self.phases.lap("prefill")
            if running:
                self._decode(running, sampling, waiting, ready, finish, chained)
            self._finish_done(ready, finish)  # held ones whose first token was their last
            self.phases.lap("other")
        self.runner.check_kernels()
        self.phases.stop()
        return [done[r.id] for r in requests]

    def _send_prefill(self, seqs: list[Sequence]):
        """Send the prefill of newly admitted requests (their admission time is now)."""
        now = time.perf_counter()
        for s in seqs:
            s.admitted = now
            s.ctx_len, s.pending_commit = s.prompt_len, 0  # the prefill writes the prompt's draft context
        ids = [s.req.id for s in seqs]
        return self._step(PrefillStep(ids, [list(s.req.prompt_token_ids) for s in seqs], self._rows(ids)))

    def _commit_prefill(self, seqs: list[Sequence], out, sampling: SamplingParams) -> None:
        """Each request's first token, from the prefill's greedy choices (read without another copy) or sampled."""
        if sampling.temperature == 0:
            tokens, margins, _ = unpack_choices(out.choices.wait(), 1)
        else:
            tokens, margins = choose(out.logits[:, None], [s.req.id for s in seqs], [s.prompt_len for s in seqs], sampling)
        now = time.perf_counter()
        for s, tok, m in zip(seqs, tokens, margins):
            s.append(tok, m, self._stops(sampling), now)

    def _stops(self, sampling: SamplingParams) -> frozenset[int]:
        return frozenset() if sampling.ignore_eos else self.eos
