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
from qual.runtime.config import EngineConfig, SamplingParams
from qual.runtime.cuda_graphs import capture_record
from qual.runtime.kv_cache import CacheManager
from qual.runtime.model_runner import ModelRunner
from qual.runtime.parallel import Comm, arm_hang_dump, init_comm, set_cpu_threads
from qual.runtime.phases import OFF, PhaseTimer
from qual.runtime.ranks import Ranks
from qual.runtime.registry import validate
from qual.runtime.scheduler import StepTally, admit, chains_prefill, fits_ahead, launches_ahead, reach, steps_to_launch
from qual.runtime.sequence import GenerationRequest, Sequence
from qual.runtime.spec_decode import choose, unpack_choices
from qual.runtime.steps import DecodeStep, PrefillStep

__all__ = ["GenerationRequest", "LLMEngine", "validate"]


class LLMEngine:
    """Target + optional DFlash drafter on tp ranks (rank 0 in this process)."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
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
            raise EngineError(f"engine start failed: {exc}") from exc
        self.K = self.runner.K
        self.phases = self.runner.phases = PhaseTimer() if cfg.phase_times else OFF
        self.async_decode = self.runner.async_decode  # greedy steps launched ahead (_decode)
        self.steps_per_launch = self.runner.steps_per_launch  # the most decode steps one launch runs
        self.steps_ahead = 0  # decode steps launched before the last one's results were read
        self.rows_retired = 0  # rows of finished requests run as padding so that a run of steps ahead went on
        self.rows_joined = 0  # rows a request held ready took over inside a run of steps ahead (_join)
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
        self.cache = CacheManager(self.runner.caches.groups, cfg.cache.block_size, cfg.parallel.dcp, cfg.cache.memory_bytes, lookahead)
        self._finished_ids: list[str] = []
        eos = self.target_cfg.eos_token_id  # an id, several (a tuple), or None: greedy runs to max_tokens
        self.eos = frozenset(eos if isinstance(eos, (tuple, list)) else ([] if eos is None else [eos]))

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
        self.comm = init_comm(0, cfg.parallel.tp, cfg.parallel.dcp, self.ranks.rendezvous.init_method, cfg.device,
                              cfg.dist_timeout_s, cfg.parallel.dcp_comm)
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
                now = time.perf_counter()
                for s in admitted:
                    s.admitted = now
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
            for s in [s for s in ready if s.finish_reason]:  # held ones whose first token was their last
                ready.remove(s)
                finish(s)
            self.phases.lap("other")
        self.runner.check_kernels()
        self.phases.stop()
        return [done[r.id] for r in requests]

    def _send_prefill(self, seqs: list[Sequence]):
        for s in seqs:
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

    def _decode(self, running: list[Sequence], sampling: SamplingParams, waiting: deque, ready: deque,
                finish: Callable[[Sequence], None], chained=None) -> None:
        """Decode steps of the running requests: one launch, or with async decode a run of them, each launched before
        the results of the one before are read, so that the host's commit and the next launch overlap the device's
        steps. A launch runs one step, or up to steps_per_launch back to back (scheduler.steps_to_launch). Requests
        that finish leave `running` through `finish` as their last launch is read.

        Launching ahead needs a batch that cannot change before the next launch but through the rows below (full, or
        nothing waiting), greedy choices (the device accepts: spec_decode.advance), a step some request is expected
        to need, and room inside every request's reservation. A request that finishes is known one launch late: the
        launch out meanwhile is read for the others, and its rows for the finished one are dropped (so are its rows
        of later steps in the launch it finished in). In the next launch a request held ready (prefill_ahead) takes
        its row over (_join), so the device never waits for the host to drain the run; without one held, the row is
        padding (retired) from then on, and the run goes on while nothing waits and the others still need a step of
        the same padded size; else it ends there.

        chained: (admitted, prefill output) of a prefill whose first tokens were not read yet (chains_prefill): the
        first step takes them on the device, and the prefill is committed while that step runs.
        """
        self._decoding_since = time.perf_counter()  # the latency record's decode steps are timed from here on
        ahead = launches_ahead(len(running), sampling.temperature == 0, self.runner.can_launch_ahead(len(running)),
                               bool(waiting or ready), self.cfg.max_num_seqs)
        rows = list(running)  # the launches' rows: row i's request (finished: padding until a held one takes it)
        size = self.runner.padded_size(len(rows))
        retired: set[int] = set()  # rows whose requests finished, padding in the steps after
        first = chained[0] if chained else ()
        steps = max(1, self._steps_to_launch(rows, 0, first)) if ahead else 1
        out, out_rows = self._launch(rows, first=first, steps=steps), list(rows)
        if chained:
            self._commit_prefill(*chained, sampling)
        while True:
            joined = self._join(rows, retired, ready, running, finish) if ahead else []
            # None held any more: the next ones are prefilled now, behind the launch in flight, and read with it
            refill = self._prefill_ahead(waiting) if ahead and self.cfg.prefill_ahead and not ready else None
            newcomers = [rows[i] for i in joined]
            old = [s for i, s in enumerate(rows) if not s.finish_reason and i not in joined]
            in_flight = steps
            steps = max(self._steps_to_launch(old, in_flight), self._steps_to_launch(newcomers, 0))
            go = ahead and steps > 0 and fits_ahead(old + newcomers, in_flight, steps, self.K, self.cfg.max_model_len)
            nxt = self._launch(rows, advanced=True, retired=retired, steps=steps, in_flight=in_flight,
                               joined=joined) if go else None
            nxt_rows = list(rows)
            self._commit(out_rows, out, sampling)
            self._finish_done(running, finish)
            if refill:
                self._commit_prefill(*refill, sampling)
                ready.extend(refill[0])
            if nxt is None:
                return
            live = [s for s in rows if not s.finish_reason]
            newly_finished = any(s.finish_reason for i, s in enumerate(rows) if i not in retired)
            goes_on = live and (ready or (not waiting and self.runner.padded_size(len(live)) == size))
            if newly_finished and not goes_on:
                self._commit(nxt_rows, nxt, sampling)
                self._finish_done(running, finish)
                return
            out, out_rows = nxt, nxt_rows

    def _join(self, rows: list[Sequence], retired: set[int], ready: deque, running: list[Sequence],
              finish: Callable[[Sequence], None]) -> list[int]:
        """Requests held ready take over the rows of requests seen finished (padding or not yet), in row order:
        returns the rows taken over. A held request whose first token was its last finishes here instead."""
        joined = []
        free = [i for i, s in enumerate(rows) if s.finish_reason]
        while ready and free:
            s = ready.popleft()
            if s.finish_reason:
                finish(s)
                continue
            i = free.pop(0)
            rows[i] = s
            retired.discard(i)
            running.append(s)
            joined.append(i)
        self.rows_joined += len(joined)
        return joined

    def _prefill_ahead(self, waiting: deque):
        """Prefill the next prefill_ahead waiting requests (a batch's worth at most) to be held ready: (admitted,
        prefill output), or None when none waits or fits."""
        admitted = admit(waiting, 0, self.cache, min(self.cfg.prefill_ahead, self.cfg.max_num_seqs),
                         self.cfg.max_prefill_tokens, self.tail)
        if not admitted:
            return None
        now = time.perf_counter()
        for s in admitted:
            s.admitted = now
        out = self._send_prefill(admitted)
        self.phases.lap("prefill")
        return admitted, out

    @staticmethod
    def _finish_done(running: list[Sequence], finish: Callable[[Sequence], None]) -> None:
        for s in [s for s in running if s.finish_reason]:
            running.remove(s)
            finish(s)

    def _steps_to_launch(self, seqs: list[Sequence], in_flight: int, unread=()) -> int:
        return steps_to_launch(seqs, in_flight, self.tally.tokens_per_step, self.steps_per_launch, unread)

    def _launch(self, seqs: list[Sequence], advanced: bool = False, retired: set[int] | None = None, first=(),
                steps: int = 1, in_flight: int = 0, joined: list[int] = ()):
        """Send one decode launch of seqs: `steps` steps back to back. advanced: launched before the last launch's
        results (`in_flight` steps) were read; the device advanced their inputs, and each request's blocks cover
        the longest it can have grown to. retired (an advanced launch's): rows already padding; rows of requests
        finished since become padding now (added). first: requests of the prefill launched just before, whose
        first tokens the device puts in. joined (an advanced launch's): rows requests held ready took over, whose
        numbers the host sends."""
        far = reach(in_flight if advanced else 0, steps, self.K)  # positions written past the committed length
        self.steps_ahead += steps if advanced or first else steps - 1
        self.launches[steps] = self.launches.get(steps, 0) + 1
        # A request whose first token is not read yet is one past its prompt, its last token a placeholder
        in_prefill = {id(s): j for j, s in enumerate(first)}  # its index in that prefill
        unread = [1 if id(s) in in_prefill else 0 for s in seqs]
        for s, extra in zip(seqs, unread):
            if not s.finish_reason:
                self.cache.ensure(s.req.id, s.num_committed + extra + far)
        newly = [i for i, s in enumerate(seqs) if s.finish_reason and i not in retired] if advanced else []
        ids = [s.req.id for s in seqs]
        if advanced:
            retired.update(newly)
            self.rows_retired += len(newly)
        # A retired row writes and reads nothing: all -1 once padded (its request's blocks are freed once it is read
        # finished; the launch in flight that still writes them runs before anything launched after, on one stream)
        live = [i for i, s in enumerate(seqs) if not s.finish_reason]
        tables = {name: [[] for _ in seqs] for name in self.cache.groups}
        for name, blocks in self._rows([ids[i] for i in live]).items():
            for i, r in zip(live, blocks):
                tables[name][i] = r
        step = DecodeStep(
            ids, [s.output[-1] if s.output else 0 for s in seqs],
            [s.num_committed + extra for s, extra in zip(seqs, unread)], [s.ctx_len for s in seqs],
            [s.pending_commit for s in seqs], tables, advanced=advanced, retired=newly,
            first_rows=[(i, in_prefill[id(s)]) for i, s in enumerate(seqs) if id(s) in in_prefill], steps=steps,
            joined=list(joined),
        )
        self.phases.lap("schedule")
        return self._step(step)

    def _commit(self, seqs: list[Sequence], out, sampling: SamplingParams) -> None:
        """Read one launch's results and commit them step by step: acceptance, tokens, the next step's draft
        context. Requests that finished before a step's results were read (async decode, or earlier in the same
        launch) are left as they are."""
        # Greedy: each step's tokens, margins and proposals cross to the host in one copy (pack_choices).
        host = out.choices.wait()
        self.phases.lap("readback")
        now = time.perf_counter()  # a launch's steps reach the host together: their tokens share its time
        for step in host:
            chosen, margins_all, drafts = unpack_choices(step, self.K + 1)
            if sampling.temperature > 0:  # a launch of one step: its logits are the step's
                chosen = choose(out.logits, [s.req.id for s in seqs], [s.num_committed for s in seqs], sampling)[0]
            for i, s in enumerate(seqs):
                if s.finish_reason:
                    continue
                targets, margins = chosen[i], margins_all[i]
                if drafts is None:
                    s.append(targets[:1], margins[:1], self._stops(sampling), now, self._decoding_since)
                    continue
                a = s.record_verify(drafts[i], targets)
                self.tally.add(a)
                s.ctx_len += s.pending_commit
                s.pending_commit = a + 1
                for name in self.cache.groups:  # the next draft step's context: ctx_len + pending_commit
                    self.cache.release_outside_window(name, s.req.id, s.ctx_len + s.pending_commit)
                s.append(targets[: a + 1], margins[: a + 1], self._stops(sampling), now, self._decoding_since)
        self.phases.lap("commit")
        self.phases.step(len(host))

    def _stops(self, sampling: SamplingParams) -> frozenset[int]:
        return frozenset() if sampling.ignore_eos else self.eos
