"""`qual run`'s progress on stderr: a live bar per arm on a terminal, plain lines in a log, nothing with --quiet.

Both say, per arm: the phase, requests done of the total, elapsed time, an ETA and the acceptance so far. A log
(stderr not a terminal) gets one line at each phase change, at every 10% of an arm's requests, and at least every
`interval_s` seconds while nothing else happened (an engine that takes half an hour to start still shows it lives).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from qual.errors import QualError
from qual.harness.execute import DECODING, DONE, REPORTS, STARTING, ArmProgress

INTERVAL_ENV = "QUAL_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 30.0  # the longest a log goes without a progress line
STEPS = 10  # a log line each time an arm passes another tenth of its requests
PREFIX = "progress: "

# What each phase can honestly be called: before an arm's first request finishes the engine starts and then
# prefills and decodes its first requests, and no engine tells those apart.
PHASE_LABELS = {STARTING: "starting engine, first requests", DECODING: "decoding", DONE: "done",
                REPORTS: "writing reports"}


def interval_s(environ=os.environ) -> float:
    """The heartbeat interval: $QUAL_PROGRESS_INTERVAL_S seconds (a number > 0), else DEFAULT_INTERVAL_S."""
    value = environ.get(INTERVAL_ENV, "")
    if value == "":
        return DEFAULT_INTERVAL_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise QualError(f"{INTERVAL_ENV}={value[:80]!r}: expected a number of seconds > 0")
    return seconds


def clock(seconds: float) -> str:
    """0:07, 12:30, 1:02:03."""
    s = max(0, int(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def eta_seconds(total: int, done: int, first_done: int | None, first_at: float | None, now: float) -> float | None:
    """Seconds left at the rate requests finished since the first one this process saw finish (so that engine
    start-up and resumed requests do not count); None until a second one has finished after it."""
    if done >= total:
        return 0.0
    if first_done is None or first_at is None or done <= first_done or now <= first_at:
        return None
    return (total - done) * (now - first_at) / (done - first_done)


def acceptance(accepted: int, drafted: int) -> str:
    """47.92% (230/480 draft tokens), or n/a before any token was drafted."""
    return f"{100 * accepted / drafted:.2f}% ({accepted}/{drafted} draft tokens)" if drafted else "n/a"


@dataclass
class _Arm:
    """An arm as the reporter follows it: its latest state and when things happened (time.monotonic)."""

    label: str
    last: ArmProgress
    started: float
    first_at: float | None = None  # the first request this process saw finish, and `done` then
    first_done: int | None = None
    ended: float | None = None
    logged_step: int = -1  # the tenth of the requests the log last showed

    def update(self, p: ArmProgress, now: float) -> None:
        if p.phase == DECODING and self.first_at is None:
            self.first_at, self.first_done = now, p.done
        if p.phase == DONE:
            self.ended = now
        self.last = p

    def facts(self, now: float) -> list[str]:
        """phase, done/total, elapsed, ETA, acceptance."""
        p = self.last
        if p.phase == REPORTS:
            return ["reports written" if self.ended else PHASE_LABELS[REPORTS],
                    f"elapsed {clock((self.ended or now) - self.started)}"]
        eta = eta_seconds(p.total, p.done, self.first_done, self.first_at, now)
        share = f" ({100 * p.done // p.total}%)" if p.total else ""
        return [PHASE_LABELS[p.phase], f"{p.done}/{p.total} requests{share}",
                f"elapsed {clock((self.ended or now) - self.started)}",
                f"ETA {'unknown' if eta is None else clock(eta)}",
                f"acceptance {acceptance(p.accepted_tokens, p.draft_tokens)}"]

    def line(self, now: float) -> str:
        return PREFIX + " | ".join([self.label, *self.facts(now)])


class RunProgress:
    """Receives the harness's ArmProgress events (call it) and shows them on `stream`; a context manager: nothing is
    shown once it has exited."""

    def __init__(self, labels: dict[str, str], *, quiet: bool = False, stream: TextIO | None = None,
                 interval: float | None = None):
        self.labels = labels  # arm -> "control (dcp 1, tp 1)"
        self.stream = stream or sys.stderr
        self.interval = interval_s() if interval is None else interval
        self.mode = "off" if quiet else "tty" if self.stream.isatty() else "log"
        self.arms: dict[str, _Arm] = {}
        self.current: _Arm | None = None
        self.lock = threading.Lock()
        self.closed = False
        self.started = self.last_line_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = None
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> "RunProgress":
        self.started = self.last_line_at = time.monotonic()
        if self.mode == "log":
            self._thread = threading.Thread(target=self._heartbeat, name="qual-progress", daemon=True)
            self._thread.start()
        elif self.mode == "tty":
            self._bar = _live_bar(self)
            self._bar.start()
        return self

    def __exit__(self, exc_type, *rest) -> None:
        self.close(succeeded=exc_type is None)

    def close(self, succeeded: bool = False) -> None:
        """Stop showing: the heartbeat thread is joined; the bar's last frame stays (reports written, if they were)."""
        with self.lock:
            self.closed = True
            run = self.arms.get("run")
            if succeeded and run is not None:
                run.ended = time.monotonic()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            if succeeded and "run" in self._tasks:
                self._bar.update(self._tasks["run"], total=1, completed=1)
            self._bar.stop()

    def __call__(self, p: ArmProgress) -> None:
        if self.mode == "off":
            return
        now = time.monotonic()
        with self.lock:
            if self.closed:
                return
            arm = self.arms.get(p.arm)
            phase_changed = arm is None or arm.last.phase != p.phase
            if arm is None:  # an arm's time runs from its start; the reports' shows the whole run's
                started = self.started if p.phase == REPORTS else now
                arm = self.arms[p.arm] = _Arm(self.labels.get(p.arm, p.arm), p, started)
            arm.update(p, now)
            self.current = arm
            if self.mode == "log":
                step = STEPS * p.done // p.total if p.total else 0
                if phase_changed or step > arm.logged_step:
                    arm.logged_step = step
                    self._write(arm.line(now), now)
        if self.mode == "tty":  # outside the lock: the bar's refresh thread takes its own, then ours (render)
            self._show(p)

    def _write(self, line: str, now: float) -> None:
        """One line in one write, flushed (called with the lock held)."""
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a reader that went away: progress is not worth failing a run for
            pass
        self.last_line_at = now

    def _heartbeat(self) -> None:
        while True:
            with self.lock:
                wait = self.last_line_at + self.interval - time.monotonic()
            if self._stop.wait(max(wait, 0.0)):
                return
            with self.lock:
                now = time.monotonic()
                if self.closed or now - self.last_line_at < self.interval:
                    continue
                if self.current is None:
                    self.last_line_at = now  # no arm has started: nothing to say yet
                else:
                    self._write(self.current.line(now), now)

    # -- the terminal ----------------------------------------------------------------------------------------------

    def _show(self, p: ArmProgress) -> None:
        bar = self._bar
        if p.arm not in self._tasks:
            self._tasks[p.arm] = bar.add_task(self.labels.get(p.arm, p.arm), total=p.total or None, arm=p.arm)
        bar.update(self._tasks[p.arm], completed=p.done if p.phase != REPORTS else 0)

    def render_facts(self, arm: str) -> str:
        """The facts of an arm's row, as of now (the bar's refresh thread calls it)."""
        with self.lock:
            state = self.arms.get(arm)
            return " | ".join(state.facts(time.monotonic())) if state else ""


def _live_bar(owner: RunProgress):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
    from rich.text import Text

    class Facts(ProgressColumn):
        def render(self, task) -> Text:
            return Text(owner.render_facts(task.fields["arm"]))

    # stdout is left alone (the verdict's), stderr writes meanwhile print above the bar
    return Progress(TextColumn("{task.description}", markup=False), BarColumn(bar_width=24), Facts(),
                    console=Console(file=owner.stream), redirect_stdout=False, transient=False)
