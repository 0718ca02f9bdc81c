"""The baseline section's rows, formatted once for every renderer (no I/O, no markup)."""

from __future__ import annotations

from dataclasses import dataclass

from qual.baseline import PREVIOUS_SERIES, BaselineComparison
from qual.report.common import ci_pp, num, pct, pp
from qual.result import Result
from qual.shown import command


@dataclass(frozen=True)
class ArmRow:
    arm: str
    compared: bool
    reason: str
    n: int
    baseline_rate: str
    tonight_rate: str
    delta_rate: str
    ci95: str
    baseline_mal: str
    tonight_mal: str
    delta_mal: str
    retokenized: int
    dropped: bool  # the 95% interval lies below zero


@dataclass(frozen=True)
class PositionRow:
    position: int
    cells: list[tuple[str, str, str, str, bool]]  # per arm: baseline, tonight, delta, 95% CI, dropped


def arm_rows(b: BaselineComparison) -> list[ArmRow]:
    rows = []
    for arm, a in b.arms.items():
        ci = a.ci_at(0.95)
        rows.append(ArmRow(
            arm, a.compared, a.reason or "", a.n_requests, pct(a.baseline_rate), pct(a.tonight_rate), pp(a.delta_rate),
            ci_pp(ci), num(a.baseline_mean_acceptance_length), num(a.tonight_mean_acceptance_length),
            num(a.delta_mean_acceptance_length, signed=True), len(a.retokenized), ci is not None and ci[1] < 0,
        ))
    return rows


def position_rows(b: BaselineComparison) -> tuple[list[str], list[PositionRow]]:
    """(arms compared, one row per draft position with each arm's baseline, tonight, delta, CI)."""
    arms = [name for name, a in b.arms.items() if a.compared]
    k = max((len(b.arms[name].per_position) for name in arms), default=0)
    rows = []
    for i in range(k):
        cells = []
        for name in arms:
            ps = b.arms[name].per_position
            p = ps[i] if i < len(ps) else {}
            ci = p.get("ci")
            cells.append((pct(p.get("baseline")), pct(p.get("tonight")), pp(p.get("delta")), ci_pp(ci),
                          ci is not None and ci[1] < 0))
        rows.append(PositionRow(i, cells))
    return arms, rows


def moved(b: BaselineComparison, n: int = 10) -> list[dict]:
    """The requests that moved most against the baseline, over the compared arms, largest move first; a request
    that moved alike in both arms is one row ("both arms")."""
    rows: dict[tuple, dict] = {}
    for name, a in b.arms.items():
        if not a.compared:
            continue
        for m in a.moved:
            key = (m["id"], m["baseline_rate"], m["tonight_rate"])
            if key in rows:
                rows[key]["arm"] = "both arms"
            else:
                rows[key] = {**m, "arm": name}
    return sorted(rows.values(), key=lambda m: (-abs(m["delta"]), m["id"], m["arm"]))[:n]


def trend_points(result: Result) -> list[tuple[str, float | None, float | None, bool, bool]]:
    """(label, control rate, candidate rate, is the baseline, is tonight) for the trend strip, oldest first."""
    b = result.baseline
    if b is None:
        return []
    points = [(f"#{t['run_id']}", t["control_rate"], t["candidate_rate"], bool(t["baseline"]), False) for t in b.trend]
    points.append(("tonight", result.control.acceptance.rate, result.candidate.acceptance.rate, False, True))
    return points


def forced(b: BaselineComparison) -> str | None:
    """The line saying a baseline of another configuration key was taken (the series before tonight's, or
    --baseline-any), None where it was not."""
    if not b.key_differences:
        return None
    keys = "; ".join(f"{d['key']}: baseline {_short(str(d['baseline']))}, tonight {_short(str(d['tonight']))}"
                     for d in b.key_differences)
    how = ("the last pass of the series before this one" if b.chosen_by == PREVIOUS_SERIES
           else "taken with --baseline-any")
    return f"another configuration, {how}: {keys}"


PIN_HINT = "pin this night to make it its series' baseline"  # followed by pin_command's command


def pin_command(b: BaselineComparison, night: object, history: object = None) -> str | None:
    """The shell command that pins tonight (night: its history id, or its run folder) as the baseline of its new
    series, where the baseline was the series before tonight's; None elsewhere, or where the night is not known."""
    if night is None or not b.key_differences or b.chosen_by != PREVIOUS_SERIES:
        return None
    return command(["qual", "history", "baseline", "pin", night, *(["--history", history] if history else [])])


def changed(b: BaselineComparison) -> str | None:
    """'changed since the baseline: engine vllm 0.32.0 -> 0.33.0; torch ...', None where nothing did."""
    return f"changed since the baseline: {'; '.join(b.changed)}" if b.changed else None


def selection(b: BaselineComparison) -> str | None:
    """Where the baseline ran another selection: how many requests each arm was compared on."""
    parts = [f"{arm} on {a.n_requests} of tonight's {a.n_requests + a.not_in_baseline}"
             for arm, a in b.arms.items() if a.compared and a.not_in_baseline]
    return f"the baseline ran another selection: compared on the requests both ran ({', '.join(parts)})" if parts else None


def differs(b: BaselineComparison, limit: int = 12) -> list[str]:
    """'candidate engine: reference -> vllm' lines, after the configuration key's own differences (a drafter swapped
    in at the same path differs in its identity alone); the keys both arms share are named once."""
    seen: dict[tuple, list[str]] = {(d["key"], str(d["baseline"]), str(d["tonight"])): ["control", "candidate"]
                                    for d in b.key_differences}
    for d in b.differs:
        seen.setdefault((d["key"], str(d["baseline"]), str(d["tonight"])), []).append(d["arm"])
    lines = [f"{'both arms' if len(arms) > 1 else arms[0]} {key}: {_short(old)} \u2192 {_short(new)}"
             for (key, old, new), arms in seen.items()]
    return lines[:limit] + ([f"and {len(lines) - limit} more"] if len(lines) > limit else [])


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."
