"""Driver (rank 0): admission, prefill, draft + verify, commit, and per-request statistics."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from qual.errors import EngineError, QualError
from qual.proc import die_with_parent
from qual.records import RequestResult
from qual.runtime.config import EngineConfig, SamplingParams
from qual.runtime.kv_cache import CacheManager
from qual.runtime.launch import (STOP_SIGNALS, adopt_environment, environment, forked_by_server,
                                 ignored_by_children, rank_context)
from qual.runtime.model_runner import ModelRunner
from qual.runtime.parallel import (Comm, Rendezvous, abort_comm, arm_hang_dump, init_comm, set_cpu_threads,
                                     shutdown_comm)
from qual.runtime.phases import OFF, PhaseTimer
from qual.runtime.registry import ModelSpec, draft_spec, target_spec
from qual.runtime.sampling import choose_tokens, top2_margins
from qual.runtime.spec_decode import SpecStats, pack_choices, unpack_choices
from qual.runtime.steps import DecodeStep, PrefillStep


@dataclass(frozen=True)
class GenerationRequest:
    id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int | None = None
    category: str = "default"


@dataclass
class _Seq:
    req: GenerationRequest
    max_tokens: int
    K: int
    output: list[int] = field(default_factory=list)
    ctx_len: int = 0  # tokens already in the draft cache
    pending_commit: int = 0  # verified tokens whose hidden states join the draft context next step
    spec: SpecStats = None  # type: ignore[assignment]
    margins: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self):
        self.spec = self.spec or SpecStats(self.K)

    @property
    def num_committed(self) -> int:
        return len(self.req.prompt_token_ids) + len(self.output)

    def result(self) -> RequestResult:
        return RequestResult(
            id=self.req.id, category=self.req.category,
            prompt_token_ids=list(self.req.prompt_token_ids), output_token_ids=list(self.output),
            drafts=self.spec.drafts, draft_tokens=self.spec.draft_tokens, accepted_tokens=self.spec.accepted,
            accepted_per_position=list(self.spec.accepted_per_pos), finish_reason=self.finish_reason or "length",
            draft_steps=self.spec.draft_steps, top2_margins=self.margins,
        )


def validate(cfg: EngineConfig) -> tuple[ModelSpec, ModelSpec | None]:
    """Read both checkpoints' configs (once) and check every constraint before any process starts."""
    target = target_spec(cfg.target_path)
    target.model_class.check_parallel(target.config, cfg.parallel)
    draft = None
    if cfg.draft_path:
        draft = draft_spec(cfg.draft_path)
        draft.model_class.check_parallel(draft.config, cfg.parallel)
        block = draft.config.block_size
        if cfg.num_speculative_tokens is not None and cfg.num_speculative_tokens > block - 1:
            raise QualError(f"num_speculative_tokens={cfg.num_speculative_tokens} exceeds what the drafter's block "
                            f"allows (block_size {block}: the last token plus at most {block - 1} drafts)")
    if cfg.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise QualError("device cuda requested but CUDA is not available")
        if torch.cuda.device_count() < cfg.parallel.world_size:
            raise QualError(f"tp={cfg.parallel.world_size} needs {cfg.parallel.world_size} GPUs; {torch.cuda.device_count()} visible")
    return target, draft


# Seconds to wait for ranks that were told to stop (a clean close) before they are killed.
STOP_JOIN_S = 30.0
# How often the driver looks at the ranks while they start.
_START_POLL_S = 0.05


def _worker_main(rank: int, cfg: EngineConfig, specs: tuple, rendezvous_dir: str, init_method: str, driver_pid: int,
                 via_server: bool, env: dict | None) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # already, from the driver (ignored_by_children); said again here
    die_with_parent(driver_pid, via_server=via_server)  # a killed driver (kill -9, OOM) takes its ranks with it
    adopt_environment(env)
    try:
        arm_hang_dump()
        set_cpu_threads(cfg.parallel.world_size, cfg.threads_per_rank)
        Path(rendezvous_dir, f"ready.{rank}").touch()  # imports done: rank 0 may enter the rendezvous now
        comm = init_comm(rank, cfg.parallel.tp, cfg.parallel.dcp, init_method, cfg.device, cfg.dist_timeout_s, cfg.parallel.dcp_comm)
        runner = ModelRunner(cfg, comm, *specs)
        while (step := comm.broadcast_object(None)) is not None:
            runner.execute(step)
        runner.close()
        shutdown_comm(comm)
    except Exception:
        traceback.print_exc()
        os._exit(1)  # a dead peer fails rank 0's next collective at once
    # Done: skip interpreter teardown. Gloo's threads can still hold tensors then, and destroying them aborted
    # about one worker in six ("terminate called without an active exception", exit code -6) after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LLMEngine:
    """Target + optional DFlash drafter on tp ranks (rank 0 in this process)."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        specs = validate(cfg)
        self.target_cfg = specs[0].config
        self.workers: list = []
        self.comm: Comm | None = None
        self._prev_threads = torch.get_num_threads()
        self._rendezvous = Rendezvous()
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
        self.run_steps = self.runner.run_steps  # decode steps a launch may run (EngineConfig.steps_per_launch)
        self.steps_ahead = 0  # decode steps launched before the last one's results were read
        self.rows_retired = 0  # rows of finished requests run as padding so that a run of steps ahead went on
        self.launches: dict[int, int] = {}  # decode launches by the steps each ran
        # Verify steps of requests so far and the tokens they committed: the mean a step commits (_run_steps)
        self._verify_steps = self._verify_tokens = 0
        # Tokens written past the committed length: the verify blocks of a launch, and with async decode those of
        # the launch in flight before it.
        lookahead = (self.K + 1) * (2 * self.run_steps if self.async_decode else 1)
        # Tokens a request's reservation holds past prompt + max_tokens: a verify block, and under async decode what
        # a launch ahead of the one in flight writes (LLMEngine._reach)
        self.tail = self._reach(self.run_steps, self.run_steps) if self.async_decode else self.K + 1
        self.cache = CacheManager(self.runner.groups, cfg.cache.block_size, cfg.parallel.dcp, cfg.cache.memory_bytes, lookahead)
        self._finished_ids: list[str] = []
        eos = self.target_cfg.eos_token_id  # an id, several (a tuple), or None: greedy runs to max_tokens
        self.eos = frozenset(eos if isinstance(eos, (tuple, list)) else ([] if eos is None else [eos]))

    def _start(self, specs: tuple) -> None:
        cfg, world = self.cfg, self.cfg.parallel.world_size
        self._start_ranks(specs)
        if world > 1:
            arm_hang_dump()
        if cfg.device == "cpu":
            set_cpu_threads(world, cfg.threads_per_rank)
        self._wait_ranks_ready()
        self.comm = init_comm(0, cfg.parallel.tp, cfg.parallel.dcp, self._rendezvous.init_method, cfg.device,
                              cfg.dist_timeout_s, cfg.parallel.dcp_comm)
        self.runner = ModelRunner(cfg, self.comm, *specs)

    def _start_ranks(self, specs: tuple) -> None:
        """Ranks 1 .. world - 1 (a one-rank engine starts no process, nor a fork server)."""
        cfg, world = self.cfg, self.cfg.parallel.world_size
        if world == 1:
            return
        ctx = rank_context(cfg.device)  # a CPU engine's fork server starts here (if no preflight started it)
        forked = forked_by_server(ctx)
        args = (cfg, specs, self._rendezvous.dir, self._rendezvous.init_method, os.getpid(), forked, environment(ctx))
        # Forked ranks take the server's dispositions, so they start outside: the first start waits for the server's
        # imports, and an interrupt meanwhile is handled at once. Spawned ranks take this process's.
        with nullcontext() if forked else ignored_by_children(STOP_SIGNALS):
            for r in range(1, world):
                p = ctx.Process(target=_worker_main, args=(r, *args), daemon=True)
                p.start()
                self.workers.append(p)

    def _wait_ranks_ready(self) -> None:
        """Wait, interruptibly, until every rank reached its rendezvous; a rank that died is an EngineError now.

        Rank 0 then enters a rendezvous that completes at once, instead of blocking in C++ (deaf to signals)
        while the ranks import torch, and for the whole process-group timeout if one of them died doing so.
        """
        deadline = time.monotonic() + self.cfg.dist_timeout_s
        pending = {r: p for r, p in enumerate(self.workers, 1)}
        while pending:
            for r, p in list(pending.items()):
                if Path(self._rendezvous.dir, f"ready.{r}").exists():
                    del pending[r]
                elif p.exitcode is not None:
                    raise EngineError(f"rank {r} exited during start (exit code {p.exitcode})")
            if pending and time.monotonic() > deadline:
                raise EngineError(f"ranks {sorted(pending)} did not start within {self.cfg.dist_timeout_s:.0f} s")
            if pending:
                time.sleep(_START_POLL_S)

    # -- lifecycle -------------------------------------------------------
    def close(self) -> None:
        """Stop the ranks in step with rank 0 (they must all be between steps), then release everything."""
        if self.comm is None:
            self.abort()
            return
        try:
            self.comm.broadcast_object(None)
            self.runner.close()
            shutdown_comm(self.comm)
            self.comm = None
            for p in self.workers:
                p.join(timeout=STOP_JOIN_S)
        except BaseException:
            self.abort()
            raise
        self.abort()  # whatever did not stop in time; then the rendezvous and threads

    def abort(self) -> None:
        """Kill the ranks and release this process's side without one more collective.

        After an interrupt or a failure, the ranks may be inside a step's collectives: a "stop" broadcast then
        meets an all-reduce, and every rank waits for the process-group timeout (or unpickles garbage).
        """
        for p in self.workers:
            if p.is_alive():
                p.kill()
        for p in self.workers:
            p.join(timeout=5)
        if self.comm is not None:
            comm, self.comm = self.comm, None
            abort_comm(comm)
        self._rendezvous.close()
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
        backend = self.runner.backend.record()
        prefill = self.runner.prefill_graphs.record() if self.runner.prefill_graphs else None
        if self.runner.graphs is None:
            why = "CUDA graphs need a CUDA device" if self.cfg.device == "cpu" else "CUDA graphs disabled (no capture sizes)"
            return {"status": "unsupported", "mode": None, "sizes": [], "seconds": None, "bytes": None, "detail": why,
                    "backend": backend, "prefill": prefill}
        record = {**self.runner.graphs.record(), "backend": backend, "prefill": prefill}
        if prefill and prefill["status"] == "captured":  # prefill chunks replayed from graphs too, not decode only
            record["mode"] = "FULL"
        return record

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
                "steps_per_launch": self.run_steps, "launches": {str(k): v for k, v in sorted(self.launches.items())}}

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
        seqs = [_Seq(r, r.max_tokens or sampling.max_tokens, self.K) for r in requests]
        for s in seqs:
            total = len(s.req.prompt_token_ids) + s.max_tokens + self.K + 1
            if not s.req.prompt_token_ids:
                raise QualError(f"request {s.req.id}: empty prompt")
            if total > self.cfg.max_model_len:
                raise QualError(f"request {s.req.id}: prompt {len(s.req.prompt_token_ids)} + max_tokens {s.max_tokens} exceeds max_model_len {self.cfg.max_model_len}")
        done: dict[str, RequestResult] = {}
        waiting, running = deque(seqs), []
        self.phases.reset()

        def finish(s: _Seq) -> None:
            self.cache.free(s.req.id)
            self._finished_ids.append(s.req.id)
            done[s.req.id] = res = s.result()
            if on_result:
                on_result(res)

        while waiting or running:
            admitted = self._admit(waiting, running)
            self.phases.lap("schedule")
            if not admitted and not running:
                raise QualError(f"request {waiting[0].req.id} does not fit the KV cache budget ({self.cfg.cache.memory_bytes} B per rank)")
            chained = None
            if admitted:
                out = self._send_prefill(admitted)
                if self._chains(running + admitted, admitted, sampling, waiting):
                    chained = (admitted, out)  # committed once the first decode step is launched behind it
                    running.extend(admitted)
                else:
                    self._commit_prefill(admitted, out, sampling)
                    for s in admitted:
                        (finish if s.finish_reason else running.append)(s)
                self.phases.lap("prefill")
            if running:
                self._decode(running, sampling, waiting, chained)
                for s in [s for s in running if s.finish_reason]:
                    running.remove(s)
                    finish(s)
            self.phases.lap("other")
        self.runner.check_kernels()
        self.phases.stop()
        return [done[r.id] for r in requests]

    def _admit(self, waiting: deque, running: list) -> list[_Seq]:
        admitted, budget = [], self.cfg.max_prefill_tokens
        while waiting and len(running) + len(admitted) < self.cfg.max_num_seqs:
            s = waiting[0]
            n = len(s.req.prompt_token_ids)
            if (admitted and n > budget) or not self.cache.can_admit(n + s.max_tokens + self.tail):
                break
            waiting.popleft()
            self.cache.admit(s.req.id, n + s.max_tokens + self.tail)
            self.cache.ensure(s.req.id, n)
            admitted.append(s)
            budget -= n
        return admitted

    def _send_prefill(self, seqs: list[_Seq]):
        for s in seqs:
            s.ctx_len, s.pending_commit = len(s.req.prompt_token_ids), 0  # the prefill writes the prompt's draft context
        ids = [s.req.id for s in seqs]
        return self._step(PrefillStep(ids, [list(s.req.prompt_token_ids) for s in seqs], self._rows(ids)))

    def _commit_prefill(self, seqs: list[_Seq], out, sampling: SamplingParams) -> None:
        """Each request's first token, from the prefill's greedy choices (read without another copy) or sampled."""
        if sampling.temperature == 0:
            tokens, margins, _ = unpack_choices(out.choices.wait(), 1)
        else:
            tokens, margins = self._choose(out.logits[:, None], seqs, [len(s.req.prompt_token_ids) for s in seqs], sampling)
        for s, tok, m in zip(seqs, tokens, margins):
            self._append(s, tok, m, sampling)

    def _chains(self, batch: list[_Seq], admitted: list[_Seq], sampling: SamplingParams, waiting: deque) -> bool:
        """Whether the first decode step of batch can be launched right behind the prefill of admitted, before its
        first tokens are read (the device puts them in): when the step could be launched ahead at all (_decode), and
        each admitted request wants a second token."""
        return self._ahead(batch, sampling, waiting) and all(s.max_tokens > 1 for s in admitted)

    def _ahead(self, seqs: list[_Seq], sampling: SamplingParams, waiting: deque) -> bool:
        return (sampling.temperature == 0 and self.runner.can_advance(len(seqs))
                and (not waiting or len(seqs) >= self.cfg.max_num_seqs))

    @staticmethod
    def _choose(logits: torch.Tensor, seqs: list[_Seq], first_positions: list[int], sampling: SamplingParams):
        """Token choices and top-2 margins for logits [R, Q, V], as lists per request.

        Greedy picks happen where the logits are, so only [R, Q] numbers cross to the host;
        sampling draws its position-keyed noise on the CPU (the same text on every device).
        """
        if sampling.temperature == 0:  # tokens and margins in one copy
            tokens, margins, _ = unpack_choices(pack_choices(logits, None).cpu(), logits.shape[1])
            return tokens, margins
        margins = top2_margins(logits).tolist()
        host = logits.float().cpu()
        return [choose_tokens(host[i], sampling.temperature, sampling.seed, s.req.id, n)
                for i, (s, n) in enumerate(zip(seqs, first_positions))], margins

    def _decode(self, seqs: list[_Seq], sampling: SamplingParams, waiting: deque, chained=None) -> None:
        """Decode steps of one batch: one launch, or with async decode a run of them, each launched before the
        results of the one before are read, so that the host's commit and the next launch overlap the device's
        steps. A launch runs one step, or up to steps_per_launch back to back (LLMEngine._run_steps).

        Launching ahead needs a batch that cannot change before the next launch (full, or nothing waiting), greedy
        choices (the device accepts: spec_decode.advance), a step some request is expected to need, and room inside
        every request's reservation. A request that finishes is known one launch late: the launch out meanwhile is
        read for the others, and its rows for the finished one are dropped (so are its rows of later steps in the
        launch it finished in). The run then goes on with the finished request's row as padding (retired) while
        nothing waits and the others still need a step of the same padded size; else it ends there.

        chained: (admitted, prefill output) of a prefill whose first tokens were not read yet (LLMEngine._chains): the
        first step takes them on the device, and the prefill is committed while that step runs.
        """
        ahead = self._ahead(seqs, sampling, waiting)
        size = self.runner.padded_size(len(seqs))
        retired: set[int] = set()  # rows whose requests finished, padding in the steps after
        first = chained[0] if chained else ()
        steps = max(1, self._run_steps(seqs, 0, first)) if ahead else 1
        out = self._launch(seqs, first=first, steps=steps)
        if chained:
            self._commit_prefill(*chained, sampling)
        while True:
            live = [s for s in seqs if not s.finish_reason]
            in_flight, steps = steps, self._run_steps(live, steps)
            go = ahead and steps > 0 and self._fits_ahead(live, in_flight, steps)
            nxt = self._launch(seqs, advanced=True, retired=retired, steps=steps, in_flight=in_flight) if go else None
            self._commit(seqs, out, sampling)
            if nxt is None:
                return
            live = [s for s in seqs if not s.finish_reason]
            newly_finished = len(live) < len(seqs) - len(retired)
            goes_on = live and not waiting and self.runner.padded_size(len(live)) == size
            if newly_finished and not goes_on:
                self._commit(seqs, nxt, sampling)
                return
            out = nxt

    def _reach(self, in_flight: int, steps: int) -> int:
        """Positions past the committed length (as the host last read it) that a launch of `steps` steps may write
        while `in_flight` steps launched before it are unread: each step commits at most K + 1 tokens and writes K
        past its own committed length."""
        return (in_flight + steps) * (self.K + 1) - 1

    def _fits_ahead(self, seqs: list[_Seq], in_flight: int, steps: int) -> bool:
        """Whether a launch before the last one is read fits: it writes up to _reach positions past each request's
        committed length, inside the request's reservation (admitted with that tail) and the static width of
        max_model_len."""
        reach = self._reach(in_flight, steps)
        return all(s.num_committed + reach <= self.cfg.max_model_len for s in seqs)

    def _run_steps(self, seqs: list[_Seq], in_flight: int, unread=()) -> int:
        """Steps the next launch runs (up to steps_per_launch; 0: none is expected to be needed, so none goes out
        before the last one is read): as many as the batch's longest request is expected to need after the
        `in_flight` steps launched before it, at the tokens a step has committed so far in this engine, over every
        request (K + 1 before the first). unread: requests whose first token (a prefill's) is not read yet. Plain
        decoding commits one token a step, so launches stop at the last token a request needs; a speculative launch
        may run a step past it (read for nothing), or stop a step early (the next launch then waits for the last
        one's results, a pause of the host's commit and launch). A heuristic of speed only: what each step computes
        is the same."""
        per = self._verify_tokens / self._verify_steps if self._verify_steps else self.K + 1
        need, unread = 0, {id(s) for s in unread}
        for s in seqs:
            left = len(s.req.prompt_token_ids) + s.max_tokens - s.num_committed - (id(s) in unread) - in_flight * per
            need = max(need, -int(-left // per))
        return min(self.run_steps, need)

    def _launch(self, seqs: list[_Seq], advanced: bool = False, retired: set[int] | None = None, first=(),
                steps: int = 1, in_flight: int = 0):
        """Send one decode launch of seqs: `steps` steps back to back. advanced: launched before the last launch's
        results (`in_flight` steps) were read; the device advanced their inputs, and each request's blocks cover
        the longest it can have grown to. retired (an advanced launch's): rows already padding; rows of requests
        finished since become padding now (added). first: requests of the prefill launched just before, whose
        first tokens the device puts in."""
        reach = self._reach(in_flight if advanced else 0, steps)  # positions written past the committed length
        self.steps_ahead += steps if advanced or first else steps - 1
        self.launches[steps] = self.launches.get(steps, 0) + 1
        # A request whose first token is not read yet is one past its prompt, its last token a placeholder
        in_prefill = {id(s): j for j, s in enumerate(first)}  # its index in that prefill
        unread = [1 if id(s) in in_prefill else 0 for s in seqs]
        for s, extra in zip(seqs, unread):
            if not s.finish_reason:
                self.cache.ensure(s.req.id, s.num_committed + extra + reach)
        newly = [i for i, s in enumerate(seqs) if s.finish_reason and i not in retired] if advanced else []
        ids = [s.req.id for s in seqs]
        tables = self._rows(ids)
        if advanced and (retired or newly):
            retired.update(newly)
            self.rows_retired += len(newly)
            for t in tables.values():  # a retired row writes and reads nothing (its blocks go when the run ends)
                for i in retired:
                    t[i] = []  # all -1 once padded
        step = DecodeStep(
            ids, [s.output[-1] if s.output else 0 for s in seqs],
            [s.num_committed + extra for s, extra in zip(seqs, unread)], [s.ctx_len for s in seqs],
            [s.pending_commit for s in seqs], tables, advanced=advanced, retired=newly,
            first_rows=[(i, in_prefill[id(s)]) for i, s in enumerate(seqs) if id(s) in in_prefill], steps=steps,
        )
        self.phases.lap("schedule")
        return self._step(step)

    def _commit(self, seqs: list[_Seq], out, sampling: SamplingParams) -> None:
        """Read one launch's results and commit them step by step: acceptance, tokens, the next step's draft
        context. Requests that finished before a step's results were read (async decode, or earlier in the same
        launch) are left as they are."""
        # Greedy: each step's tokens, margins and proposals cross to the host in one copy (pack_choices).
        host = out.choices.wait()
        self.phases.lap("readback")
        for step in host:
            chosen, margins_all, drafts = unpack_choices(step, self.K + 1)
            if sampling.temperature > 0:  # a launch of one step: its logits are the step's
                chosen = self._choose(out.logits, seqs, [s.num_committed for s in seqs], sampling)[0]
            for i, s in enumerate(seqs):
                if s.finish_reason:
                    continue
                n = s.num_committed
                targets, margins = chosen[i], margins_all[i]
                if drafts is None:
                    self._append(s, targets[:1], margins[:1], sampling)
                    continue
                a = s.spec.record(n, drafts[i], targets)
                self._verify_steps += 1
                self._verify_tokens += a + 1
                s.ctx_len += s.pending_commit
                s.pending_commit = a + 1
                for name in self.cache.groups:  # the next draft step's context: ctx_len + pending_commit
                    self.cache.release_outside_window(name, s.req.id, s.ctx_len + s.pending_commit)
                self._append(s, targets[: a + 1], margins[: a + 1], sampling)
        self.phases.lap("commit")
        self.phases.step(len(host))

    def _append(self, s: _Seq, tokens: list[int], margins: list[float], sampling: SamplingParams) -> None:
        """Commit verified tokens up to max_tokens / EOS."""
        for tok, m in zip(tokens, margins):
            s.output.append(tok)
            s.margins.append(m)
            if not sampling.ignore_eos and tok in self.eos:
                s.finish_reason = "stop"
                return
            if len(s.output) >= s.max_tokens:
                s.finish_reason = "length"
                return
