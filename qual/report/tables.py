"""Rows of the report's per-position and per-request tables, derived from one Result (no I/O, no markup)."""

from __future__ import annotations

from dataclasses import dataclass

from qual.result import Result


@dataclass(frozen=True)
class PositionRow:
    """One draft position: both arms' rates, candidate - control with its 95% interval, unconditional and
    conditional, and how often proposals at identical context differ."""

    i: int
    c: float | None
    k: float | None
    d: float | None
    ci: list[float] | None
    cc: float | None
    kc: float | None
    dc: float | None
    cci: list[float] | None
    prop: float | None


def _at(xs: list, i: int):
    return xs[i] if i < len(xs) else None


def _diff(x: float | None, y: float | None) -> float | None:
    return y - x if x is not None and y is not None else None


def position_rows(result: Result) -> list[PositionRow]:
    """Per draft position; the intervals come from result.json's comparison.per_position (none in older results)."""
    a, b = result.control.acceptance, result.candidate.acceptance
    intervals = {p["position"]: p for p in result.comparison.per_position}
    prop = (result.comparison.proposal_divergence or {}).get("per_position", [])
    rows = []
    for i in range(max(len(a.per_position), len(b.per_position))):
        c, k = _at(a.per_position, i), _at(b.per_position, i)
        cc, kc = _at(a.per_position_conditional, i), _at(b.per_position_conditional, i)
        p = intervals.get(i, {})
        rows.append(PositionRow(i, c, k, _diff(c, k), p.get("ci"), cc, kc, _diff(cc, kc), p.get("conditional_ci"),
                                _at(prop, i)))
    return rows


def position_intervals(result: Result) -> dict[str, list[list[float] | None]]:
    """Each arm's 95% interval per position, unconditional and conditional, for the figure's whiskers."""
    rows = sorted(result.comparison.per_position, key=lambda p: p["position"])
    keys = ("control", "candidate", "control_conditional", "candidate_conditional")
    return {key: [p.get(f"{key}_ci") for p in rows] for key in keys}


@dataclass(frozen=True)
class RequestRow:
    id: str
    category: str
    control_rate: float | None
    candidate_rate: float | None
    delta: float | None
    tokens: str  # output tokens: one number where both arms produced as many, else "control / candidate"
    history_differs: bool = False  # a later turn whose earlier turns differ between the arms


def request_rows(result: Result) -> list[RequestRow]:
    """Every paired request, largest drop first (ties in corpus order); requests without drafts (no delta) last."""
    lengths = {arm: {r.id: len(r.output_token_ids) for r in a.per_request} for arm, a in result.arms.items()}
    rows = []
    for r in result.comparison.per_request_deltas:
        c, k = lengths["control"].get(r["id"]), lengths["candidate"].get(r["id"])
        tokens = str(c) if c == k else f"{c if c is not None else 'n/a'} / {k if k is not None else 'n/a'}"
        rows.append(RequestRow(r["id"], r["category"], r["control_rate"], r["candidate_rate"], r["delta"], tokens,
                               bool(r.get("earlier_turns_differ"))))
    return sorted(rows, key=lambda r: (r.delta is None, r.delta or 0.0))
