"""Host time of the engine loop by phase (rank 0), for finding where a step's time goes.

A lap timer: `lap(phase)` charges the time since the previous lap to `phase`, so the phases of a step add
up to its wall time without nesting. Off (the default), the engine holds `OFF`, whose laps do nothing.

On CUDA the host runs ahead of the device until it needs a result: the launch phases (`draft`, `verify`,
`graph`) are launch time, and `readback` is where the host waits for the step's device work to finish.
"""

from __future__ import annotations

import time

# schedule: admission, block allocation, the step's metadata; send: the step to the other ranks;
# inputs: this rank's slots, masks and views on the device; draft / verify: their launches (eager);
# graph: the draft + verify step as one CUDA-graph replay or compiled call; readback: the step's
# token choices, proposals and margins on the host; commit: acceptance, appending tokens, the next
# step's pending draft context; prefill: whole prefill steps, their first tokens read and committed (inside a run of
# launches ahead too); other: the rest of generate (results).
PHASES = ("schedule", "send", "inputs", "draft", "verify", "graph", "readback", "commit", "prefill", "other")


class PhaseTimer:
    """Seconds per phase over one generate call, and its decode steps."""

    enabled = True

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.decode_steps = 0
        self.wall = 0.0
        self._start = self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def step(self, steps: int = 1) -> None:
        """Count a launch's decode steps (several when a launch runs more than one: EngineConfig.steps_per_launch)."""
        self.decode_steps += steps

    def stop(self) -> None:
        self.lap("other")
        self.wall = self._last - self._start

    def record(self) -> dict:
        """{decode_steps, wall_s, seconds: {phase: s}, ms_per_step: {phase: ms}} (ms per decode step)."""
        n = max(1, self.decode_steps)
        return {"decode_steps": self.decode_steps, "wall_s": self.wall, "seconds": dict(self.seconds),
                "ms_per_step": {p: 1e3 * s / n for p, s in self.seconds.items()}}


class _Off:
    """The timer when phase times are off: every call is a no-op."""

    enabled = False

    def reset(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def step(self, steps: int = 1) -> None:
        pass

    def stop(self) -> None:
        pass

    def record(self) -> None:
        return None


OFF = _Off()
