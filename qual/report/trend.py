"""History rows as plots of nights (qual.report.plots.Panel): `qual history trend --out` and the published site draw
the same panels, on the same axis choice (qual.nights.axis_value), with the same marks."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Sequence

from qual.history import HistoryRun, StepChange, position
from qual.history.store import MAX_RUN_ID
from qual.nights import axis_value, facts_of
from qual.report.plots import Column, Panel, arm_lines

# The strip's column of the run being reported: recorded after every row there (ids end at MAX_RUN_ID), so it is the
# last column on any axis but the date
TONIGHT = MAX_RUN_ID + 1


def when(created_at: str) -> datetime:
    """A night's time (UTC; a created_at that is not a time sorts first)."""
    try:
        t = datetime.fromisoformat(created_at)
    except ValueError:
        return datetime.min.replace(tzinfo=timezone.utc)
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def title(run: HistoryRun, note: str | None = None) -> str:
    """A night's tooltip: 'run 12 · 2026-11-20 02:00 UTC · commit 1a2b3c4 · vllm 0.32.0 · FAIL', an error night's
    cause after it, then the note (why the night has no report)."""
    parts = [f"run {run.id}", f"{run.created_at[:16].replace('T', ' ')} UTC",
             f"commit {(run.qual_commit or 'n/a')[:7]}", run.facts.get("engine") or run.engine, run.outcome.upper(),
             run.error if run.is_error else None, note]
    return " \u00b7 ".join(p for p in parts if p)


def column(run: HistoryRun, axis: str, href: str | None = None, note: str | None = None,
           hollow: bool = False) -> Column:
    """One night on a plot along axis, linking to href (hollow: it has no report; note: why)."""
    return Column(run.id, when(run.created_at), position(run, axis), run.outcome, run.facts.get("engine"), href,
                  title(run, note), hollow)


def arms_panel(label: str, runs: Sequence[HistoryRun], columns: Sequence[Column], steps: Sequence[StepChange] = (),
               href: str | None = None) -> Panel:
    """Both arms' acceptance over a series' nights (oldest first; columns: each night's column), its step changes
    ringed, titled label (linking to href)."""
    index = {r.id: i for i, r in enumerate(runs)}
    rings = [(index[s.run_id], s.after) for s in steps if s.run_id in index]
    return Panel("acceptance (%)", columns, arm_lines([r.control_rate for r in runs], [r.candidate_rate for r in runs]),
                 label, href, rings)


def strip_panel(result) -> Panel:
    """The report's strip (a qual.result.Result judged against a baseline): both arms over the last recorded runs of
    its configuration and tonight, along the recorded axis (qual run --axis; a result without one: the date), the
    baseline ringed, tonight named."""
    bl = result.baseline
    tonight = {"run_id": TONIGHT, "created_at": result.created_at, "verdict": result.gate.outcome,
               "control_rate": result.control.acceptance.rate, "candidate_rate": result.candidate.acceptance.rate,
               "engine": result.candidate.engine_version, "qual": facts_of(result)["qual"], "meta": result.meta}
    nights = [*bl.trend, tonight]
    columns = [Column(t["run_id"], when(t["created_at"]), strip_value(t, bl.axis), t["verdict"], t.get("engine"),
                      title=f"run {t['run_id']}" if t["run_id"] != TONIGHT else "tonight") for t in nights]
    rings = [(i, t["candidate_rate"]) for i, t in enumerate(bl.trend)
             if t["baseline"] and t["candidate_rate"] is not None]
    return Panel("acceptance (%)", columns, arm_lines([t["control_rate"] for t in nights],
                                                      [t["candidate_rate"] for t in nights]),
                 rings=rings, ring_label="baseline", tonight=len(nights) - 1)


def strip_value(night: dict, axis: str) -> str | None:
    """A strip record's place on the axis (qual.nights.axis_value): a record written before the strip followed an
    axis holds no qual label or --meta labels, and reads as a night that did not record them."""
    meta = night.get("meta")
    return axis_value(axis, night["created_at"], {"engine": night.get("engine"), "qual": night.get("qual")},
                      meta if isinstance(meta, dict) else {})
