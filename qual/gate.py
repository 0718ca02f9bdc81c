"""Gate rules (qual.gate_rules) evaluated against a Result into named checks: pass, fail, inconclusive or skipped,
each with its prose and its numbers (value, threshold, op, unit; per arm for a check over both arms).

A check decided on an interval's bound (the rate delta against the control, and each arm against a baseline) is
INCONCLUSIVE where the interval straddles its threshold: the data cannot tell, and it names how many requests would
resolve it at the variance observed. The gate's outcome is FAIL where any check failed, else INCONCLUSIVE where any
check was, else PASS; what INCONCLUSIVE exits with is the gate file's `inconclusive:` (docs/statistics.md, "Gate").
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Callable

from qual import paths
from qual.errors import QualError
from qual.gate_rules import RULES, Gate, GateRule, parse_rules
from qual.outcomes import FAIL, INCONCLUSIVE, PASS
from qual.records import GRAPH_NOT_OBSERVED
from qual.result import FIRST_NIGHT, ArmResult, CheckNumbers, CheckResult, GateOutcome, Result
from qual.stats import DEFAULT_NEAR_TIE_MARGIN
from qual.userfiles import check_path_name, load_yaml
from qual.validation import read_config_text

__all__ = ["BASELINE_CHECKS", "CHECKS", "Gate", "GateRule", "evaluate", "load_gate", "parse_rules"]

# ---------------------------------------------------------------- formatting helpers


def _pp(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.2f} pp"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.2f}%"


def _numbers(value: float | None, threshold: float | None, op: str, unit: str) -> CheckNumbers:
    return CheckNumbers(value=value, threshold=threshold, op=op, unit=unit)


# ---------------------------------------------------------------- a lower bound decided on an interval

def needed_requests(lo: float, hi: float, point: float, threshold: float, n: int) -> int | None:
    """Requests that would move the interval's near side off the threshold at the variance observed: an interval's
    half-width shrinks as 1/sqrt(n), so its side toward the threshold, (point - lo) or (hi - point), must shrink to
    the point's distance from it. None where that side has no width (zero variance) or the point is on the threshold
    (no number of requests moves it off)."""
    side, gap = (point - lo, point - threshold) if point >= threshold else (hi - point, threshold - point)
    if side <= 0 or gap <= _ON_THRESHOLD:
        return None
    return max(n + 1, math.ceil(n * (side / gap) ** 2))


_ON_THRESHOLD = 1e-9  # a point this close to its threshold (a rate difference: a fraction) is on it


def _lower_bound(ci: tuple[float, float], point: float, min_pp: float, n: int) -> tuple[str, int | None]:
    """A lower bound that must clear min_pp: pass where the whole interval does, fail where none of it does,
    inconclusive where it straddles (with the requests that would resolve it)."""
    lo, hi = ci
    threshold = min_pp / 100.0
    if lo >= threshold:
        return PASS, None
    if hi < threshold:
        return FAIL, None
    return INCONCLUSIVE, needed_requests(lo, hi, point, threshold, n)


def _bound_words(outcome: str, lo: float, hi: float, min_pp: float, confidence: float, needed: int | None,
                 n: int, unit: str) -> str:
    """'lower bound -0.20 pp >= -0.50 pp', or why the interval does not decide."""
    if outcome == PASS:
        return f"lower bound {lo * 100:+.2f} pp >= {min_pp:+.2f} pp"
    if outcome == FAIL:
        return f"lower bound {lo * 100:+.2f} pp < {min_pp:+.2f} pp (the whole interval is below it)"
    more = (f"about {needed} {unit} would resolve it at this variance" if needed is not None
            else "no number of requests resolves it at this variance")
    return (f"lower bound {lo * 100:+.2f} pp < {min_pp:+.2f} pp but the {confidence:.0%} interval reaches "
            f"{hi * 100:+.2f} pp: inconclusive at {n} {unit} ({more})")


# ---------------------------------------------------------------- checks


def _acceptance_delta_lower_bound(result: Result, min_pp: float, confidence: float) -> CheckResult:
    name = "acceptance_delta_lower_bound"
    cmp = result.comparison
    rc, rk = result.control.acceptance.rate, result.candidate.acceptance.rate
    numbers = dict(threshold=float(min_pp), op=">=", unit="pp")
    if rc is None or rk is None:
        which = " and ".join(a for a, r in (("control", rc), ("candidate", rk)) if r is None)
        return CheckResult(name, False, f"acceptance undefined: no draft tokens in {which}", **numbers)
    ci = cmp.ci_at(confidence)
    if ci is None or cmp.delta_rate is None:
        return CheckResult(name, False, f"no {confidence:.0%} bootstrap interval was computed for this result",
                           **numbers)
    lo, hi = ci
    n = int(cmp.bootstrap.get("n_requests") or len(result.control.per_request))
    unit = "conversations" if cmp.bootstrap.get("unit") == "conversation" else "requests"
    outcome, needed = _lower_bound(ci, cmp.delta_rate, min_pp, n)
    detail = (f"candidate {_pct(rk)} vs control {_pct(rc)}: delta {_pp(cmp.delta_rate)}, "
              f"{confidence:.0%} CI [{lo * 100:+.2f}, {hi * 100:+.2f}] pp; "
              + _bound_words(outcome, lo, hi, min_pp, confidence, needed, n, unit))
    return CheckResult(name, outcome == PASS, detail, inconclusive=outcome == INCONCLUSIVE, needed_requests=needed,
                       value=lo * 100, **numbers)


def _mean_acceptance_length_ratio(result: Result, min: float) -> CheckResult:
    name = "mean_acceptance_length_ratio"
    mc = result.control.acceptance.mean_acceptance_length
    mk = result.candidate.acceptance.mean_acceptance_length
    numbers = dict(threshold=float(min), op=">=", unit="ratio")
    if mc is None or mk is None:
        return CheckResult(name, False, "mean acceptance length undefined: an arm made no drafts", **numbers)
    ratio = mk / mc
    passed = ratio >= min
    op = ">=" if passed else "<"
    detail = f"candidate {mk:.3f} / control {mc:.3f} = {ratio:.4f} {op} {min:.4f}"
    return CheckResult(name, passed, detail, value=ratio, **numbers)


def _target_outputs_identical(
    result: Result, when_temperature: float | None, allow: str, near_tie_margin: float
) -> CheckResult:
    name = "target_outputs_identical"
    numbers = dict(threshold=0.0, op="==", unit="requests")  # requests whose divergence the rule does not allow
    temps = {a.config.get("sampling", {}).get("temperature") for a in (result.control, result.candidate)}
    if when_temperature is not None and temps != {when_temperature}:
        shown = ", ".join(str(t) for t in sorted(temps, key=str))
        return CheckResult(name, False, f"skipped: temperature {shown}, rule applies at temperature {when_temperature}",
                           skipped=True, **numbers)
    cmp = result.comparison
    n = len(result.control.per_request)
    if not (result.control.runnable and result.candidate.runnable):
        return CheckResult(name, False, "not compared: an arm did not run", **numbers)
    if n == 0:
        return CheckResult(name, False, "no paired requests to compare", **numbers)
    div = cmp.output_divergence
    if not div:
        return CheckResult(name, True, f"{n}/{n} requests: target outputs identical", value=0.0, **numbers)
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
    disallowed = len(confident) + (len(benign) if allow == "none" else 0)
    return CheckResult(name, passed, "; ".join(parts), value=float(disallowed), **numbers)


def _captured_sizes(arm: ArmResult) -> set[int]:
    g = arm.graph_capture
    if g.get("status") != "captured":
        return set()
    return set(g.get("sizes") or []) - set(g.get("eager_fallback_sizes") or [])


def _graph_sizes_captured(result: Result) -> CheckResult:
    name = "graph_sizes_captured"
    numbers = dict(threshold=0.0, op="==", unit="sizes")  # control sizes the candidate lacks
    gc, gk = result.control.graph_capture, result.candidate.graph_capture
    sc, sk = gc.get("status"), gk.get("status")
    unseen = [arm for arm, status in (("control", sc), ("candidate", sk)) if status == GRAPH_NOT_OBSERVED]
    if unseen:  # an attached server captured (or not) before qual saw it: neither a pass nor a failure
        return CheckResult(name, False, f"skipped: graph capture not observed in {' and '.join(unseen)} "
                           f"(control {sc}, candidate {sk}); qual did not start that server", skipped=True, **numbers)
    if sc == "unsupported" and sk == "unsupported":
        return CheckResult(name, True, "graph capture unsupported in both arms: nothing to compare", value=0.0,
                           **numbers)
    want, have = _captured_sizes(result.control), _captured_sizes(result.candidate)
    if not want:
        return CheckResult(name, True, f"control captured no sizes (status {sc}); candidate status {sk}", value=0.0,
                           **numbers)
    missing = sorted(want - have)
    fallback = sorted(set(gk.get("eager_fallback_sizes") or []) & want)
    if not missing:
        return CheckResult(name, True, f"all {len(want)} control sizes captured in candidate: {sorted(want)}",
                           value=0.0, **numbers)
    detail = f"candidate (status {sk}) lacks {len(missing)}/{len(want)} control sizes: {missing}"
    if fallback:
        detail += f"; claimed but ran eager: {fallback}"
    if gk.get("detail"):
        detail += f"; {gk['detail']}"
    return CheckResult(name, False, detail, value=float(len(missing)), **numbers)


def _candidate_runnable(result: Result) -> CheckResult:
    k = result.candidate
    numbers = dict(threshold=1.0, op="==", unit="ran")
    if k.runnable:
        return CheckResult("candidate_runnable", True, f"candidate ran {len(k.per_request)} requests", value=1.0,
                           **numbers)
    return CheckResult("candidate_runnable", False,
                       f"candidate not runnable: {k.not_runnable_reason or 'no reason given'}", value=0.0, **numbers)


# ---------------------------------------------------------------- checks against a baseline and absolute floors

BASELINE_CHECKS = ("baseline_delta_lower_bound", "per_position_delta", "category_delta")


def _no_baseline(result: Result, name: str, without_baseline: str) -> CheckResult:
    # Never a silent pass: either the rule says it may be skipped (and the detail says it was), or it fails. The first
    # night of a series under history:last-pass has nothing to compare with: skipped, and said so.
    if result.first_night:
        return CheckResult(name, False, f"skipped: {FIRST_NIGHT}", skipped=True)
    if without_baseline == "skip":
        return CheckResult(name, False, "skipped: no baseline given (the rule says without_baseline: skip)", skipped=True)
    return CheckResult(name, False, "no baseline given: this rule compares each arm with one (qual run --baseline REF, "
                                    "e.g. history:last-pass; or without_baseline: skip)")


def _baseline_arms(result: Result, name: str, arms: list[str], without_baseline: str):
    """(compared arms, failures for arms that could not be compared), or a CheckResult when there is no baseline."""
    if result.baseline is None:
        return _no_baseline(result, name, without_baseline)
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


def _worst(outcomes: list[str]) -> str:
    return FAIL if FAIL in outcomes else INCONCLUSIVE if INCONCLUSIVE in outcomes else PASS


def _baseline_delta_lower_bound(result: Result, min_pp: float, confidence: float, arms: list[str],
                                without_baseline: str) -> CheckResult:
    name = "baseline_delta_lower_bound"
    got = _baseline_arms(result, name, arms, without_baseline)
    if isinstance(got, CheckResult):
        return got
    compared, parts = got
    outcomes = [FAIL] * len(parts)
    per_arm: dict[str, CheckNumbers] = {}
    needs = []
    for arm, b in compared:
        ci = b.ci_at(confidence)
        if b.delta_rate is None or ci is None:
            outcomes.append(FAIL)
            per_arm[arm] = _numbers(None, float(min_pp), ">=", "pp")
            parts.append(f"{arm}: no {confidence:.0%} interval (no draft tokens on one side)")
            continue
        lo, hi = ci
        outcome, needed = _lower_bound(ci, b.delta_rate, min_pp, b.n_requests)
        outcomes.append(outcome)
        needs.append(needed)  # None unless inconclusive
        per_arm[arm] = _numbers(lo * 100, float(min_pp), ">=", "pp")
        parts.append(
            f"{arm} {_pct(b.tonight_rate)} vs baseline {_pct(b.baseline_rate)} on {b.n_requests} requests: delta "
            f"{_pp(b.delta_rate)}, {confidence:.0%} CI [{lo * 100:+.2f}, {hi * 100:+.2f}] pp; "
            + _bound_words(outcome, lo, hi, min_pp, confidence, needed, b.n_requests, "requests") + _retokenized(b)
        )
    outcome = _worst(outcomes)
    needed = max((n for n in needs if n is not None), default=None)  # the arm that needs the most decides
    return CheckResult(name, outcome == PASS, "; ".join(parts), inconclusive=outcome == INCONCLUSIVE,
                       needed_requests=needed if outcome == INCONCLUSIVE else None, threshold=float(min_pp), op=">=",
                       unit="pp", per_arm=per_arm)


def _per_position_delta(result: Result, max_pp: float, arms: list[str], positions: list[int] | None,
                        without_baseline: str) -> CheckResult:
    name = "per_position_delta"
    got = _baseline_arms(result, name, arms, without_baseline)
    if isinstance(got, CheckResult):
        return got
    compared, parts = got
    passed = not parts
    per_arm: dict[str, CheckNumbers] = {}
    for arm, b in compared:
        rows = {p["position"]: p for p in b.per_position}
        wanted = sorted(rows) if positions is None else positions
        absent = [i for i in wanted if i not in rows]
        dropped = [rows[i] for i in wanted if i in rows and rows[i]["delta"] is not None and rows[i]["delta"] * 100 < -max_pp]
        deltas = [rows[i]["delta"] for i in wanted if i in rows and rows[i]["delta"] is not None]
        per_arm[arm] = _numbers(None if absent or not deltas else min(deltas) * 100, -float(max_pp), ">=", "pp")
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
    return CheckResult(name, passed, "; ".join(parts), threshold=-float(max_pp), op=">=", unit="pp", per_arm=per_arm)


def _category_delta(result: Result, max_pp: float, arms: list[str], without_baseline: str) -> CheckResult:
    name = "category_delta"
    got = _baseline_arms(result, name, arms, without_baseline)
    if isinstance(got, CheckResult):
        return got
    compared, parts = got
    passed = not parts
    per_arm: dict[str, CheckNumbers] = {}
    for arm, b in compared:
        rows = [c for c in b.per_category if c.get("delta") is not None]
        per_arm[arm] = _numbers(min((c["delta"] for c in rows), default=0.0) * 100, -float(max_pp), ">=", "pp")
        dropped = sorted((c for c in rows if c["delta"] * 100 < -max_pp), key=lambda c: (c["delta"], c["category"]))
        if dropped:
            passed = False
            shown = ", ".join(f"{c['category']} ({c['n']} requests) {_pct(c['baseline_rate'])} -> {_pct(c['tonight_rate'])} "
                              f"({_pp(c['delta'])})" for c in dropped[:5])
            more = f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
            parts.append(f"{arm}: {len(dropped)} of {len(rows)} categories dropped more than {max_pp:.2f} pp: {shown}{more}")
        else:
            parts.append(f"{arm}: no category of {len(rows)} dropped more than {max_pp:.2f} pp")
    return CheckResult(name, passed, "; ".join(parts), threshold=-float(max_pp), op=">=", unit="pp", per_arm=per_arm)


def _acceptance_floor(result: Result, min_rate: float | None, min_mean_acceptance_length: float | None,
                      arms: list[str], models: list[str] | None) -> CheckResult:
    """Each arm's numbers are its binding floor's: the one it failed, else the rate's where a rate floor is set."""
    name = "acceptance_floor"
    model = result.candidate.config.get("model")
    if models is not None and model not in models:
        return CheckResult(name, False, f"skipped: floors set for model(s) {', '.join(models)}; this run is {model}",
                           skipped=True)
    passed, parts = True, []
    per_arm: dict[str, CheckNumbers] = {}
    for arm in arms:
        a = result.arms[arm]
        if not a.runnable:
            passed = False
            parts.append(f"{arm}: did not run")
            continue
        rate, mal = a.acceptance.rate, a.acceptance.mean_acceptance_length
        bits, floors = [], []
        if min_rate is not None:
            ok = rate is not None and rate >= min_rate
            passed &= ok
            floors.append((ok, _numbers(rate, float(min_rate), ">=", "rate")))
            bits.append(f"rate {_pct(rate)} {'>=' if ok else '<'} {_pct(min_rate)}")
        if min_mean_acceptance_length is not None:
            ok = mal is not None and mal >= min_mean_acceptance_length
            passed &= ok
            floors.append((ok, _numbers(mal, float(min_mean_acceptance_length), ">=", "mean acceptance length")))
            shown = "n/a" if mal is None else f"{mal:.3f}"
            bits.append(f"mean acceptance length {shown} {'>=' if ok else '<'} {min_mean_acceptance_length:.3f}")
        per_arm[arm] = next((n for ok, n in floors if not ok), floors[0][1])
        parts.append(f"{arm}: {', '.join(bits)}")
    return CheckResult(name, passed, "; ".join(parts), per_arm=per_arm)


# ---------------------------------------------------------------- registry

# check name -> the function evaluating it (its parameters: the rule's, qual.gate_rules)
CHECKS: dict[str, Callable[..., CheckResult]] = {
    "acceptance_delta_lower_bound": _acceptance_delta_lower_bound,
    "mean_acceptance_length_ratio": _mean_acceptance_length_ratio,
    "target_outputs_identical": _target_outputs_identical,
    "graph_sizes_captured": _graph_sizes_captured,
    "candidate_runnable": _candidate_runnable,
    "baseline_delta_lower_bound": _baseline_delta_lower_bound,
    "per_position_delta": _per_position_delta,
    "category_delta": _category_delta,
    "acceptance_floor": _acceptance_floor,
}
assert set(CHECKS) == set(RULES)


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
    sha256 = "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()  # the bytes read: strict UTF-8 round-trips
    return dataclasses.replace(parse_rules(load_yaml(text, str(path)), str(path)), sha256=sha256)


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
    """Run every rule against a result (its gate field is ignored) in file order; the outcome is FAIL > INCONCLUSIVE >
    PASS over the checks evaluated (skipped checks decide nothing; a gate whose every check was skipped fails)."""
    checks = [CHECKS[r.check](result, **r.params) for r in gate.rules]
    return GateOutcome.of(checks, gate.source, gate.inconclusive)
