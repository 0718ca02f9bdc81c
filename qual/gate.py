"""Gate rules from YAML, evaluated against a Result into named pass/fail checks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from qual import paths
from qual.errors import QualError
from qual.userfiles import check_path_name, load_yaml
from qual.validation import read_config_text, shown
from qual.records import GRAPH_NOT_OBSERVED
from qual.result import ARMS, ArmResult, CheckResult, GateOutcome, Result
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
        return CheckResult(name, False, f"skipped: temperature {shown}, rule applies at temperature {when_temperature}",
                           skipped=True)
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
    if cmp.earlier_turns_differ:  # their prompts differ because an earlier turn's output did: counted there
        parts.append(f"{len(cmp.earlier_turns_differ)} later turns not compared (their earlier turns differ)")
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


# ---------------------------------------------------------------- checks against a baseline and absolute floors

BASELINE_CHECKS = ("baseline_delta_lower_bound", "per_position_delta", "category_delta")


def _no_baseline(name: str, without_baseline: str) -> CheckResult:
    # Never a silent pass: either the rule says it may be skipped (and the detail says it was), or it fails.
    if without_baseline == "skip":
        return CheckResult(name, False, "skipped: no baseline given (the rule says without_baseline: skip)", skipped=True)
    return CheckResult(name, False, "no baseline given: this rule compares each arm with one (qual run --baseline REF, "
                                    "e.g. history:last-pass; or without_baseline: skip)")


def _baseline_arms(result: Result, name: str, arms: list[str], without_baseline: str):
    """(compared arms, failures for arms that could not be compared), or a CheckResult when there is no baseline."""
    if result.baseline is None:
        return _no_baseline(name, without_baseline)
    compared, problems = [], []
    for arm in arms:
        b = result.baseline.arms.get(arm)
        if b is None or not b.compared:
            problems.append(f"{arm}: not compared ({b.reason if b is not None else 'no such arm in the baseline'})")
        else:
            compared.append((arm, b))
    return compared, problems


def _retokenized(b) -> str:
    return f" ({len(b.retokenized)} requests tokenized differently from the baseline)" if b.retokenized else ""


def _baseline_delta_lower_bound(result: Result, min_pp: float, confidence: float, arms: list[str],
                                without_baseline: str) -> CheckResult:
    name = "baseline_delta_lower_bound"
    got = _baseline_arms(result, name, arms, without_baseline)
    if isinstance(got, CheckResult):
        return got
    compared, parts = got
    passed = not parts
    for arm, b in compared:
        ci = b.ci_at(confidence)
        if b.delta_rate is None or ci is None:
            passed = False
            parts.append(f"{arm}: no {confidence:.0%} interval (no draft tokens on one side)")
            continue
        lo, hi = ci
        ok = lo * 100.0 >= min_pp
        passed &= ok
        parts.append(
            f"{arm} {_pct(b.tonight_rate)} vs baseline {_pct(b.baseline_rate)} on {b.n_requests} requests: delta "
            f"{_pp(b.delta_rate)}, {confidence:.0%} CI [{lo * 100:+.2f}, {hi * 100:+.2f}] pp; lower bound "
            f"{lo * 100:+.2f} pp {'>=' if ok else '<'} {min_pp:+.2f} pp{_retokenized(b)}"
        )
    return CheckResult(name, passed, "; ".join(parts))


def _per_position_delta(result: Result, max_pp: float, arms: list[str], positions: list[int] | None,
                        without_baseline: str) -> CheckResult:
    name = "per_position_delta"
    got = _baseline_arms(result, name, arms, without_baseline)
    if isinstance(got, CheckResult):
        return got
    compared, parts = got
    passed = not parts
    for arm, b in compared:
        rows = {p["position"]: p for p in b.per_position}
        wanted = sorted(rows) if positions is None else positions
        absent = [i for i in wanted if i not in rows]
        dropped = [rows[i] for i in wanted if i in rows and rows[i]["delta"] is not None and rows[i]["delta"] * 100 < -max_pp]
        if absent:
            passed = False
            parts.append(f"{arm}: position(s) {absent} not drafted (K = {len(rows)})")
        if dropped:
            passed = False
            shown = ", ".join(
                f"{p['position']}: {_pct(p['baseline'])} -> {_pct(p['tonight'])} ({_pp(p['delta'])}"
                + (f", 95% CI [{p['ci'][0] * 100:+.2f}, {p['ci'][1] * 100:+.2f}]" if p.get("ci") else "") + ")"
                for p in dropped
            )
            parts.append(f"{arm}: position(s) {', '.join(str(p['position']) for p in dropped)} dropped more than "
                         f"{max_pp:.2f} pp against the baseline: {shown}")
        elif not absent:
            worst = min((rows[i] for i in wanted if rows[i]["delta"] is not None), key=lambda p: p["delta"], default=None)
            tail = f"; largest drop at position {worst['position']} ({_pp(worst['delta'])})" if worst and worst["delta"] < 0 else ""
            parts.append(f"{arm}: no position of {len(wanted)} dropped more than {max_pp:.2f} pp{tail}")
    return CheckResult(name, passed, "; ".join(parts))


def _category_delta(result: Result, max_pp: float, arms: list[str], without_baseline: str) -> CheckResult:
    name = "category_delta"
    got = _baseline_arms(result, name, arms, without_baseline)
    if isinstance(got, CheckResult):
        return got
    compared, parts = got
    passed = not parts
    for arm, b in compared:
        rows = [c for c in b.per_category if c.get("delta") is not None]
        dropped = sorted((c for c in rows if c["delta"] * 100 < -max_pp), key=lambda c: (c["delta"], c["category"]))
        if dropped:
            passed = False
            shown = ", ".join(f"{c['category']} ({c['n']} requests) {_pct(c['baseline_rate'])} -> {_pct(c['tonight_rate'])} "
                              f"({_pp(c['delta'])})" for c in dropped[:5])
            more = f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
            parts.append(f"{arm}: {len(dropped)} of {len(rows)} categories dropped more than {max_pp:.2f} pp: {shown}{more}")
        else:
            parts.append(f"{arm}: no category of {len(rows)} dropped more than {max_pp:.2f} pp")
    return CheckResult(name, passed, "; ".join(parts))


def _acceptance_floor(result: Result, min_rate: float | None, min_mean_acceptance_length: float | None,
                      arms: list[str], models: list[str] | None) -> CheckResult:
    name = "acceptance_floor"
    model = result.candidate.config.get("model")
    if models is not None and model not in models:
        return CheckResult(name, False, f"skipped: floors set for model(s) {', '.join(models)}; this run is {model}",
                           skipped=True)
    passed, parts = True, []
    for arm in arms:
        a = result.arms[arm]
        if not a.runnable:
            passed = False
            parts.append(f"{arm}: did not run")
            continue
        rate, mal = a.acceptance.rate, a.acceptance.mean_acceptance_length
        bits = []
        if min_rate is not None:
            ok = rate is not None and rate >= min_rate
            passed &= ok
            bits.append(f"rate {_pct(rate)} {'>=' if ok else '<'} {_pct(min_rate)}")
        if min_mean_acceptance_length is not None:
            ok = mal is not None and mal >= min_mean_acceptance_length
            passed &= ok
            shown = "n/a" if mal is None else f"{mal:.3f}"
            bits.append(f"mean acceptance length {shown} {'>=' if ok else '<'} {min_mean_acceptance_length:.3f}")
        parts.append(f"{arm}: {', '.join(bits)}")
    return CheckResult(name, passed, "; ".join(parts))


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
    validate: Callable[[dict], str | None] | None = None  # rules across parameters: a problem, or None


def _is_arms(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(a in ARMS for a in v) and len(set(v)) == len(v)


def _is_positions(v: Any) -> bool:
    return v is None or (isinstance(v, list) and bool(v) and len(set(v)) == len(v)
                         and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v))


def _is_names(v: Any) -> bool:
    return v is None or (isinstance(v, list) and bool(v) and all(isinstance(n, str) and n for n in v))


_ARMS = _Param(_is_arms, "a non-empty list of distinct arms (control, candidate)", list(ARMS))
_WITHOUT_BASELINE = _Param(lambda v: v in ("fail", "skip"), "'fail' or 'skip'", "fail")
_MAX_PP = _Param(lambda v: _is_number(v) and v >= 0, "a number of percentage points >= 0", required=True)


def _some_floor(params: dict) -> str | None:
    if params["min_rate"] is None and params["min_mean_acceptance_length"] is None:
        return "give min_rate, min_mean_acceptance_length or both (a floor of neither checks nothing)"
    return None


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
    "baseline_delta_lower_bound": _Check(
        _baseline_delta_lower_bound,
        {
            "min_pp": _Param(_is_number, "a number of percentage points", required=True),
            "confidence": _Param(lambda v: _is_number(v) and 0 < v < 1, "a number in (0, 1)", 0.95),
            "arms": _ARMS,
            "without_baseline": _WITHOUT_BASELINE,
        },
    ),
    "per_position_delta": _Check(
        _per_position_delta,
        {
            "max_pp": _MAX_PP,
            "arms": _ARMS,
            "positions": _Param(_is_positions, "null or a non-empty list of distinct draft positions (integers >= 0)"),
            "without_baseline": _WITHOUT_BASELINE,
        },
    ),
    "category_delta": _Check(_category_delta, {"max_pp": _MAX_PP, "arms": _ARMS, "without_baseline": _WITHOUT_BASELINE}),
    "acceptance_floor": _Check(
        _acceptance_floor,
        {
            "min_rate": _Param(lambda v: v is None or (_is_number(v) and 0 <= v <= 1), "null or a rate in [0, 1]"),
            "min_mean_acceptance_length": _Param(lambda v: v is None or (_is_number(v) and v >= 1),
                                                 "null or a mean acceptance length >= 1"),
            "arms": _ARMS,
            "models": _Param(_is_names, "null or a non-empty list of model profile names"),
        },
        _some_floor,
    ),
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
        problem = spec.validate(params) if spec.validate is not None else None
        if problem:
            raise QualError(f"{where} ({name}): {problem}")
        rules.append(GateRule(name, params, i, source))
    return Gate(tuple(rules), source)


def shipped_gates() -> list[str]:
    """The gates found by name ($QUAL_ROOT, the checkout's configs/gates, the package's copy)."""
    return list(paths.available("gate"))


def gate_file(name_or_path: str | Path) -> Path:
    """A gate file: a path as given, or the name of a shipped one (`nightly`, `nightly-baseline`)."""
    check_path_name(name_or_path, "--gate")
    path = Path(name_or_path)
    if path.exists() or path.suffix in (".yaml", ".yml") or len(path.parts) != 1:
        return path
    found = paths.find("gate", path.name)
    return found.path if found else path


def load_gate(path: str | Path) -> Gate:
    """Read and validate a gate YAML file (a path, or a shipped gate's name)."""
    path = gate_file(path)
    try:
        text = read_config_text(path)
    except OSError as exc:
        raise QualError(f"cannot read gate file {path}: {exc.strerror or exc} "
                        f"(shipped gates: {', '.join(shipped_gates())})") from None
    return parse_rules(load_yaml(text, str(path)), str(path))


def near_tie_margin(gate: Gate) -> float:
    """The margin build_result classifies divergences with: the strictest target_outputs_identical rule's."""
    margins = [p["near_tie_margin"] for p in gate.params_of("target_outputs_identical")]
    return min(margins) if margins else DEFAULT_NEAR_TIE_MARGIN


def confidences(gate: Gate) -> list[float]:
    """Bootstrap confidence levels the gate needs, always including 0.95 (result.json's delta_rate_ci95)."""
    return sorted({0.95, *(float(p["confidence"]) for p in gate.params_of("acceptance_delta_lower_bound"))})


def baseline_confidences(gate: Gate) -> list[float]:
    """Confidence levels the baseline comparison needs, always including 0.95 (shown in the reports)."""
    return sorted({0.95, *(float(p["confidence"]) for p in gate.params_of("baseline_delta_lower_bound"))})


def needs_baseline(gate: Gate) -> list[GateRule]:
    """Rules that fail without a baseline (those not marked without_baseline: skip)."""
    return [r for r in gate.rules if r.check in BASELINE_CHECKS and r.params["without_baseline"] == "fail"]


def evaluate(gate: Gate, result: Result) -> GateOutcome:
    """Run every rule against a result (its gate field is ignored) in file order."""
    checks = [CHECKS[r.check].fn(result, **r.params) for r in gate.rules]
    evaluated = [c for c in checks if not c.skipped]
    # Skipped checks decide nothing; a gate whose every check was skipped decided nothing either, and fails.
    return GateOutcome(passed=bool(evaluated) and all(c.passed for c in evaluated), checks=checks, source=gate.source)
