"""The driver's runs of decode launches, a part of LLMEngine (qual/runtime/engine.py, which keeps start, stop,
records and the admission loop): launch, read back and commit, launching ahead where async decode allows, retiring
the rows of finished requests and letting requests held ready take them over. Uses the engine's runner, cache,
config, phase timer, step tally and counters (set by LLMEngine.__init__), and its `_step`, `_rows`,
`_send_prefill`, `_commit_prefill` and `_stops`."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from qual.runtime.config import SamplingParams
from qual.runtime.scheduler import admit, fits_ahead, launches_ahead, reach, steps_to_launch
from qual.runtime.sequence import Sequence
from qual.runtime.spec_decode import choose, unpack_choices
from qual.runtime.steps import DecodeStep


class DecodeRuns:
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
            self.phases.lap("prefill")
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
                self.phases.lap("prefill")  # its readback's wait, which the next launch's schedule would take in
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
        out = self._send_prefill(admitted)
        self.phases.lap("prefill")
        return admitted, out

    @staticmethod
    def _finish_done(seqs: list[Sequence] | deque, finish: Callable[[Sequence], None]) -> None:
        """Finish the requests of `seqs` that are done, and take them out of it."""
        for s in [s for s in seqs if s.finish_reason]:
            seqs.remove(s)
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
        committed = [s.num_committed + (id(s) in in_prefill) for s in seqs]
        for s, n in zip(seqs, committed):
            if not s.finish_reason:
                self.cache.ensure(s.req.id, n + far)
        newly = [i for i, s in enumerate(seqs) if s.finish_reason and i not in retired] if advanced else []
        ids = [s.req.id for s in seqs]
        if advanced:
            retired.update(newly)
            self.rows_retired += len(newly)
        # A retired row writes and reads nothing: all -1 once padded (its request's blocks are freed once it is read
        # finished; the launch in flight that still writes them runs before anything launched after, on one stream)
        live = [i for i, s in enumerate(seqs) if not s.finish_reason]
        live_ids = [ids[i] for i in live]
        # A launch ahead whose rows and their blocks are the last launch's leaves the tables on the device as they are
        # (most launches ahead: blocks are taken at admission): no tables to build, pack or copy
        tables = None
        if not advanced or newly or joined or self.cache.tables_changed(live_ids):
            tables = {name: [[] for _ in seqs] for name in self.cache.groups}
            for name, blocks in self._rows(live_ids).items():
                for i, r in zip(live, blocks):
                    tables[name][i] = r
            self.cache.tables_sent()
        else:
            self.tables_kept += 1
        step = DecodeStep(
            ids, [s.output[-1] if s.output else 0 for s in seqs], committed, [s.ctx_len for s in seqs],
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
        stops = self._stops(sampling)
        for step in host:
            chosen, margins_all, drafts = unpack_choices(step, self.K + 1)
            if sampling.temperature > 0:  # a launch of one step: its logits are the step's
                chosen = choose(out.logits, [s.req.id for s in seqs], [s.num_committed for s in seqs], sampling)[0]
            for i, s in enumerate(seqs):
                if s.finish_reason:
                    continue
                targets, margins = chosen[i], margins_all[i]
                if drafts is None:
                    s.append(targets[:1], margins[:1], stops, now, self._decoding_since)
                    continue
                a = s.record_verify(drafts[i], targets)
                self.tally.add(a)
                s.ctx_len += s.pending_commit
                s.pending_commit = a + 1
                for name in self.cache.windowed:  # the next draft step's context: ctx_len + pending_commit
                    self.cache.release_outside_window(name, s.req.id, s.ctx_len + s.pending_commit)
                s.append(targets[: a + 1], margins[: a + 1], stops, now, self._decoding_since)
        self.phases.lap("commit")
        self.phases.step(len(host))
