"""A sweep's matrix: one row per candidate against the one control (no I/O, no markup), for every renderer."""

from __future__ import annotations

from dataclasses import dataclass

from qual.outcomes import PASS
from qual.report import common
from qual.result import Result
from qual.sweep_result import SweepResult

# The candidate settings a sweep varies, as the matrix names them (ArmConfig keys)
SETTINGS = {"dcp": "DCP", "tp": "TP", "draft_kv": "draft KV", "dsa_topk": "DSA top-k"}


@dataclass(frozen=True)
class MatrixRow:
    name: str  # the candidate arm's name (its section's id on the page)
    settings: str  # "DCP 2, TP 2, draft KV sharded"
    rate: str  # the candidate's acceptance rate
    delta: str  # candidate - control, pp
    ci: str  # its 95% interval, pp
    mal_ratio: str  # candidate / control mean acceptance length
    identical: str  # target outputs identical: "yes (16/16)", "no: ...", "n/a"
    graphs: str  # the candidate's graph capture (status and sizes), and the control's where they differ
    graphs_differ: bool
    passed: bool  # its gate passed (exit 0)
    failed: list[str]  # the checks that failed or were inconclusive
    outcome: str = PASS  # pass | fail | inconclusive

    @property
    def verdict(self) -> str:
        return self.outcome.upper()


def _settings(result: Result) -> str:
    k = result.candidate.config
    return ", ".join(f"{label} {k[key]}" for key, label in SETTINGS.items() if k.get(key) is not None)


def _mal_ratio(result: Result) -> str:
    a, b = result.control.acceptance.mean_acceptance_length, result.candidate.acceptance.mean_acceptance_length
    return common.num(b / a if a and b is not None else None, 4)


def _graphs(result: Result) -> tuple[str, bool]:
    rows = {f: (a, b, differs) for f, a, b, differs in common.graph_rows(result)}
    (cs, ks, status_differs), (csz, ksz, sizes_differ) = rows["status"], rows["sizes"]
    text, control = (ks if ksz == "none" else f"{ks}: {ksz}"), (cs if csz == "none" else f"{cs}: {csz}")
    if status_differs or sizes_differ:
        return f"{text} (control {control})", True
    return text, False


def row(name: str, result: Result) -> MatrixRow:
    identical = next(h.delta for h in common.headline(result) if h.label == "target outputs identical")
    graphs, differ = _graphs(result)
    return MatrixRow(name=name, settings=_settings(result), rate=common.pct(result.candidate.acceptance.rate),
                     delta=common.pp(result.comparison.delta_rate), ci=common.ci_pp(result.comparison.delta_rate_ci95),
                     mal_ratio=_mal_ratio(result), identical=identical, graphs=graphs, graphs_differ=differ,
                     passed=result.gate.passed, failed=[c.name for c in result.gate.not_passed],
                     outcome=result.gate.outcome)


def rows(sweep: SweepResult) -> list[MatrixRow]:
    return [row(name, result) for name, result in sweep.results()]


def title(sweep: SweepResult) -> str:
    """'toy: DCP 1 → 4 candidates (DCP 2, 4 × draft KV replicated, sharded; reference, TP 4 control)'."""
    configs = [c.candidate.config for c in sweep.comparisons]
    varied = []
    for key, label in SETTINGS.items():
        seen = list(dict.fromkeys(str(k.get(key)) for k in configs))
        if len(seen) > 1 and key != "tp":  # TP follows DCP unless --tp holds it
            varied.append(f"{label} {', '.join(seen)}")
    c, axes = sweep.control.config, " \u00d7 ".join(varied) or "one setting"
    return (f"{c.get('model', '?')}: DCP 1 \u2192 {len(configs)} candidates ({axes}; {c.get('engine', '?')}, control "
            f"at TP {c.get('tp', '?')})")


def control_line(sweep: SweepResult) -> str:
    """The control's acceptance: what every row's delta is against."""
    a = sweep.control.acceptance
    return (f"control (DCP {sweep.control.config.get('dcp', '?')}, TP {sweep.control.config.get('tp', '?')}): "
            f"{common.pct(a.rate)} acceptance, mean acceptance length {common.num(a.mean_acceptance_length)}, "
            f"{len(sweep.control.per_request)} requests, {sweep.control.throughput.wall_seconds:.1f} s, run once")


def interval_note(sweep: SweepResult) -> str | None:
    """common.interval_note of the sweep's comparisons (they replay the same requests): the first that has one."""
    return next((n for _, result in sweep.results() if (n := common.interval_note(result)) is not None), None)
