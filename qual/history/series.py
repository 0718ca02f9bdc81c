"""Series: the nights of one configuration key, oldest first, along an axis (date, engine, qual, a --meta key); what
changed between consecutive nights; step changes in acceptance between them."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from qual.errors import QualError
from qual.history.runs import HistoryRun, list_runs, recorded_order
from qual.nights import axis_value, changes

DEFAULT_STEP_PP = 2.0


def trend(db_path: str | Path, model: str | None = None, **filters: Any) -> dict[str, list[HistoryRun]]:
    """Runs grouped by series (their configuration key's label), oldest first within each."""
    return group_series(list_runs(db_path, model=model, limit=None, **filters))


def by_configuration(runs: Sequence[HistoryRun]) -> dict[str, list[HistoryRun]]:
    """Runs by configuration key (a row from before keys were stored: by its label), oldest first within each, the
    configurations in the order of their first nights."""
    by_key: dict[str, list[HistoryRun]] = {}
    for run in sorted(runs, key=recorded_order):
        by_key.setdefault(run.configuration or run.series, []).append(run)
    return by_key


def group_series(runs: Sequence[HistoryRun]) -> dict[str, list[HistoryRun]]:
    """Runs by configuration key, oldest first within each, under the key's label."""
    by_key = by_configuration(runs)
    labels = [rows[0].series for rows in by_key.values()]
    # A label leaves some fields out (the seed where it is 0...): keys that share one are told apart by their hash.
    return {(label if labels.count(label) == 1 else f"{label} #{key_hash(key)}"): rows
            for label, (key, rows) in zip(labels, by_key.items())}


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def changed(previous: HistoryRun, night: HistoryRun) -> list[str]:
    """What changed between two nights of a series: the software and machine under test."""
    return changes(previous.facts, night.facts)


def position(run: HistoryRun, axis: str) -> str | None:
    """A night's place on the axis (qual.nights.axis_value)."""
    return axis_value(axis, run.created_at, run.facts, run.meta)


# ---------------------------------------------------------------- step changes


@dataclass(frozen=True)
class StepChange:
    """A jump in one arm's acceptance between consecutive nights of one series that have rates (error rows have
    none)."""

    series: str
    arm: str  # control | candidate
    previous_run_id: int
    run_id: int
    created_at: str
    before: float
    after: float
    notes: list[str] = field(default_factory=list)  # what changed between the two nights (engine, torch, corpus...)

    @property
    def delta(self) -> float:
        return self.after - self.before

    def describe(self) -> str:
        note = f" ({'; '.join(self.notes)})" if self.notes else ""
        return (
            f"{self.series}: {self.arm} {self.before * 100:.2f}% -> {self.after * 100:.2f}% "
            f"({self.delta * 100:+.2f} pp) between run {self.previous_run_id} and run {self.run_id}{note}"
        )


def check_step_pp(threshold_pp: float) -> float:
    """--threshold-pp as given, or QualError (exit 2) for a negative, infinite or NaN one (NaN would flag nothing and
    infinity nothing ever, silently)."""
    if isinstance(threshold_pp, bool) or not isinstance(threshold_pp, (int, float)) or \
            not math.isfinite(threshold_pp) or threshold_pp < 0:
        raise QualError(f"--threshold-pp {threshold_pp!r}: expected a finite number of percentage points >= 0")
    return float(threshold_pp)


def detect_step_changes(runs: Sequence[HistoryRun], threshold_pp: float = DEFAULT_STEP_PP) -> list[StepChange]:
    """Flag |change| > threshold_pp in either arm's rate between consecutive nights of the same series (an error
    night between them is passed over: it measured nothing). threshold_pp: a finite number >= 0, else QualError."""
    check_step_pp(threshold_pp)
    steps = []
    for series, rows in group_series(runs).items():
        measured = [r for r in rows if not r.is_error]
        for prev, cur in zip(measured, measured[1:]):
            notes = ["corpus fingerprint changed"] if prev.corpus_fingerprint != cur.corpus_fingerprint else []
            notes += changed(prev, cur)
            for arm in ("control", "candidate"):
                before, after = getattr(prev, f"{arm}_rate"), getattr(cur, f"{arm}_rate")
                if before is None or after is None:
                    continue
                if abs(after - before) * 100 > threshold_pp:
                    steps.append(StepChange(series, arm, prev.id, cur.id, cur.created_at, before, after, list(notes)))
    return steps
