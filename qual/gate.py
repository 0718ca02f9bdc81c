"""Gate rules from YAML, evaluated against a Result into named pass/fail checks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from qual.errors import QualError
from qual.validation import read_config_text, shown
from qual.records import GRAPH_NOT_OBSERVED
from qual.result import ArmResult, CheckResult, GateOutcome, Result
from qual.stats import DEFAULT_NEAR_TIE_MARGIN


@dataclass(frozen=True)
class GateRule:
    """One rule of a gate file: a check name and its validated parameters."""

    check: str
    params: dict
    index: int = 0
    source: str = "<inline>"

    def to_json(self) -> dict:
        return {"check": self.check, **self.params}


@dataclass(frozen=True)
class Gate:
    """An ordered list of rules and the file they came from."""

    rules: tuple[GateRule, ...]
    source: str = "<inline>"

    def params_of(self, check: str) -> list[dict]:
        return [r.params for r in self.rules if r.check == check]


# ---------------------------------------------------------------- formatting helpers


def _pp(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.2f} pp"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.2f}%"


# ---------------------------------------------------------------- checks


def _acceptance_delta_lower_bound(result: Result, min_pp: float, confidence: float) -> CheckResult:
    cmp = result.comparison
    rc, rk = result.control.acceptance.rate, result.candidate.acceptance.rate
    if rc is None or rk is None:
        which = " and ".join(a for a, r in (("control", rc), ("candidate", rk)) if r is None)
        return CheckResult("acceptance_delta_lower_bound", False, f"acceptance undefined: no draft tokens in {which}")
    ci = cmp.ci_at(confidence)
    if ci is None:
        return CheckResult(
            "acceptance_delta_lower_bound", False, f"no {confidence:.0%} bootstrap interval was computed for this result"
        )
    lo, hi = ci
    passed = lo * 100.0 >= min_pp
    op = ">=" if passed else "<"
    detail = (
        f"candidate {_pct(rk)} vs control {_pct(rc)}: delta {_pp(cmp.delta_rate)}, "
        f"{confidence:.0%} CI [{lo * 100:+.2f}, {hi * 100:+.2f}] pp; lower bound {lo * 100:+.2f} pp {op} {min_pp:+.2f} pp"
    )
    return CheckResult("acceptance_delta_lower_bound", passed, detail)


def _mean_acceptance_length_ratio(result: Result, min: float) -> CheckResult:
    mc = result.control.acceptance.mean_acceptance_length
    mk = result.candidate.acceptance.mean_acceptance_length
    if mc is None or mk is None:
        return CheckResult("mean_acceptance_length_ratio", False, "mean acceptance length undefined: an arm made no drafts")
    ratio = mk / mc
    passed = ratio >= min
    op = ">=" if passed else "<"
    detail = f"candidate {mk:.3f} / control {mc:.3f} = {ratio:.4f} {op} {min:.4f}"
    return CheckResult("mean_acceptance_length_ratio", passed, detail)


def _target_outputs_identical(
    result: Result, when_temperature: float | None, allow: str, near_tie_margin: float
) -> CheckResult:
    name = "target_outputs_identical"
    temps = {a.config.get("sampling", {}).get("temperature") for a in (result.control, result.candidate)}
    if when_temperature is not None and temps != {when_temperature}:
        shown = ", ".join(str(t) for t in sorted(temps, key=str))
        return CheckResult(name, True, f"skipped: temperature {shown}, rule applies at temperature {when_temperature}")
    cmp = result.comparison
    n = len(result.control.per_request)
    if not (result.control.runnable and result.candidate.runnable):
        return CheckResult(name, False, "not compared: an arm did not run")
    if n == 0:
        return CheckResult(name, False, "no paired requests to compare")
    div = cmp.output_divergence
    if not div:
        return CheckResult(name, True, f"{n}/{n} requests: target outputs identical")
    # Re-classify with this rule's threshold: the stored margins are the evidence.
    benign, confident = [], []
    for d in div:
        m = d.get("top2_margin")
        (benign if m is not None and m < near_tie_margin else confident).append(d)
    passed = allow == "benign_near_tie" and not confident
    parts = [f"{len(div)}/{n} requests diverge"]
    if benign:
        parts.append(f"{len(benign)} benign near-tie (top-2 margin < {near_tie_margin:g})")
    if confident:
        shown = ", ".join(
            f"{d['id']}@{d['first_divergence']} (margin {'n/a' if d.get('top2_margin') is None else format(d['top2_margin'], '.3g')})"
            for d in confident[:5]
        )
        more = f" and {len(confident) - 5} more" if len(confident) > 5 else ""
        parts.append(f"{len(confident)} disagreement: {shown}{more}")
    if allow == "none" and benign and not confident:
        parts.append("near ties not allowed by this rule")
    return CheckResult(name, passed, "; ".join(parts))


def _captured_sizes(arm: ArmResult) -> set[int]:
    g = arm.graph_capture
    if g.get("status") != "captured":
        return set()
    return set(g.get("sizes") or []) - set(g.get("eager_fallback_sizes") or [])


def _graph_sizes_captured(result: Result) -> CheckResult:
    name = "graph_sizes_captured"
    gc, gk = result.control.graph_capture, result.candidate.graph_capture
    sc, sk = gc.get("status"), gk.get("status")
    unseen = [arm for arm, status in (("control", sc), ("candidate", sk)) if status == GRAPH_NOT_OBSERVED]
    if unseen:  # an attached server captured (or not) before qual saw it: neither a pass nor a failure
        return CheckResult(name, False, f"skipped: graph capture not observed in {' and '.join(unseen)} "
                           f"(control {sc}, candidate {sk}); qual did not start that server", skipped=True)
    if sc == "unsupported" and sk == "unsupported":
        return CheckResult(name, True, "graph capture unsupported in both arms: nothing to compare")
    want, have = _captured_sizes(result.control), _captured_sizes(result.candidate)
    if not want:
        return CheckResult(name, True, f"control captured no sizes (status {sc}); candidate status {sk}")
    missing = sorted(want - have)
    fallback = sorted(set(gk.get("eager_fallback_sizes") or []) & want)
    if not missing:
        return CheckResult(name, True, f"all {len(want)} control sizes captured in candidate: {sorted(want)}")
    detail = f"candidate (status {sk}) lacks {len(missing)}/{len(want)} control sizes: {missing}"
    if fallback:
        detail += f"; claimed but ran eager: {fallback}"
    if gk.get("detail"):
        detail += f"; {gk['detail']}"
    return CheckResult(name, False, detail)


def _candidate_runnable(result: Result) -> CheckResult:
    k = result.candidate
    if k.runnable:
        return CheckResult("candidate_runnable", True, f"candidate ran {len(k.per_request)} requests")
    return CheckResult("candidate_runnable", False, f"candidate not runnable: {k.not_runnable_reason or 'no reason given'}")


# ---------------------------------------------------------------- registry and parsing

_NUMBER = (int, float)


def _is_number(v: Any) -> bool:
    """A finite int or float (NaN would pass every comparison it is not in; -inf would disable a check)."""
    return isinstance(v, _NUMBER) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class _Param:
    check: Callable[[Any], bool]
    what: str
    default: Any = None
    required: bool = False


@dataclass(frozen=True)
class _Check:
    fn: Callable[..., CheckResult]
    params: dict[str, _Param]


CHECKS: dict[str, _Check] = {
    "acceptance_delta_lower_bound": _Check(
        _acceptance_delta_lower_bound,
        {
            "min_pp": _Param(_is_number, "a number of percentage points", required=True),
            "confidence": _Param(lambda v: _is_number(v) and 0 < v < 1, "a number in (0, 1)", 0.95),
        },
    ),
    "mean_acceptance_length_ratio": _Check(
        _mean_acceptance_length_ratio,
        {"min": _Param(lambda v: _is_number(v) and v > 0, "a positive number", required=True)},
    ),
    "target_outputs_identical": _Check(
        _target_outputs_identical,
        {
            "when_temperature": _Param(lambda v: v is None or (_is_number(v) and v >= 0), "a temperature >= 0 or null", 0),
            "allow": _Param(lambda v: v in ("none", "benign_near_tie"), "'none' or 'benign_near_tie'", "none"),
            "near_tie_margin": _Param(lambda v: _is_number(v) and v >= 0, "a logit margin >= 0", DEFAULT_NEAR_TIE_MARGIN),
        },
    ),
    "graph_sizes_captured": _Check(_graph_sizes_captured, {}),
    "candidate_runnable": _Check(_candidate_runnable, {}),
}


def parse_rules(data: Any, source: str = "<inline>") -> Gate:
    """Validate a gate document (a list of rules, or a mapping with `rules:`) into a Gate."""
    if isinstance(data, dict):
        unknown = set(data) - {"rules", "name", "description"}
        if unknown:
            raise QualError(f"{source}: unknown top-level keys {shown(sorted(map(str, unknown)))} (expected rules, name, description)")
        data = data.get("rules")
    if not isinstance(data, list) or not data:
        raise QualError(f"{source}: expected a non-empty list of rules")
    rules = []
    for i, raw in enumerate(data):
        where = f"{source}: rule {i}"
        if not isinstance(raw, dict) or "check" not in raw:
            raise QualError(f"{where}: expected a mapping with a 'check' key, got {shown(raw)}")
        name = raw["check"]
        spec = CHECKS.get(name) if isinstance(name, str) else None
        if spec is None:
            raise QualError(f"{where}: unknown check {shown(name)} (known: {', '.join(sorted(CHECKS))})")
        given = {k: v for k, v in raw.items() if k != "check"}
        extra = sorted(set(given) - set(spec.params))
        if extra:
            allowed = ", ".join(spec.params) or "none"
            raise QualError(f"{where} ({name}): unknown parameter(s) {shown(extra)} (allowed: {allowed})")
        params = {}
        for pname, p in spec.params.items():
            if pname not in given:
                if p.required:
                    raise QualError(f"{where} ({name}): missing parameter {pname!r} ({p.what})")
                params[pname] = p.default
                continue
            if not p.check(given[pname]):
                raise QualError(f"{where} ({name}): {pname} must be {p.what}, got {shown(given[pname])}")
            params[pname] = given[pname]
        rules.append(GateRule(name, params, i, source))
    return Gate(tuple(rules), source)


def load_gate(path: str | Path) -> Gate:
    """Read and validate a gate YAML file."""
    path = Path(path)
    try:
        text = read_config_text(path)
    except OSError as exc:
        raise QualError(f"cannot read gate file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise QualError(f"{where}: invalid YAML ({getattr(exc, 'problem', None) or exc})") from None
    return parse_rules(data, str(path))


def near_tie_margin(gate: Gate) -> float:
    """The margin build_result classifies divergences with: the strictest target_outputs_identical rule's."""
    margins = [p["near_tie_margin"] for p in gate.params_of("target_outputs_identical")]
    return min(margins) if margins else DEFAULT_NEAR_TIE_MARGIN


def confidences(gate: Gate) -> list[float]:
    """Bootstrap confidence levels the gate needs, always including 0.95 (result.json's delta_rate_ci95)."""
    return sorted({0.95, *(float(p["confidence"]) for p in gate.params_of("acceptance_delta_lower_bound"))})


def evaluate(gate: Gate, result: Result) -> GateOutcome:
    """Run every rule against a result (its gate field is ignored) in file order."""
    checks = [CHECKS[r.check].fn(result, **r.params) for r in gate.rules]
    evaluated = [c for c in checks if not c.skipped]
    # Skipped checks decide nothing; a gate whose every check was skipped decided nothing either, and fails.
    return GateOutcome(passed=bool(evaluated) and all(c.passed for c in evaluated), checks=checks, source=gate.source)
