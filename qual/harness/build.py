"""Build the Result of a run from both arms' engine output: summarise, compare (paired, bootstrapped), gate."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from qual.baseline import ARMS, BaselineArm, BaselineComparison
from qual.gate import Gate, baseline_confidences, confidences, evaluate, load_gate, near_tie_margin
from qual.harness.baseline import ResolvedBaseline, differences
from qual.history import HistoryRun, configuration_of
from qual.records import ArmConfig, ArmRunInfo, RequestResult
from qual.result import ArmResult, Comparison, CorpusInfo, GateOutcome, Result, Throughput, ci_key
from qual.stats import (
    DEFAULT_NEAR_TIE_MARGIN,
    DEFAULT_RESAMPLES,
    acceptance_summary,
    compare_outputs,
    pair_by_id,
    pair_requests,
    paired_bootstrap,
    per_category,
    per_position_deltas,
    per_request_deltas,
    proposal_divergence,
)

MOVED_REQUESTS = 10  # requests listed per arm as having moved most against the baseline


def arm_result(config: ArmConfig | dict, info: ArmRunInfo, requests: Sequence[RequestResult]) -> ArmResult:
    """Summarise one arm's engine output."""
    g = info.graph_capture
    graph = asdict(g) if not isinstance(g, dict) else dict(g)
    return ArmResult(
        config=config.to_json() if isinstance(config, ArmConfig) else dict(config),
        acceptance=acceptance_summary(requests),
        per_request=list(requests),
        graph_capture=graph,
        throughput=Throughput(info.wall_seconds, info.output_tokens, info.tokens_per_second, info.generate_seconds),
        engine_version=info.engine_version,
        runnable=info.runnable,
        not_runnable_reason=info.not_runnable_reason,
        log_path=info.log_path,
    )


def compare_arms(
    control: Sequence[RequestResult],
    candidate: Sequence[RequestResult],
    *,
    seed: int = 0,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence_levels: Sequence[float] = (0.95,),
    near_tie: float = DEFAULT_NEAR_TIE_MARGIN,
) -> Comparison:
    """Paired comparison of two arms' per-request results (raises QualError if replay was not matched)."""
    control, candidate = pair_requests(control, candidate)
    levels = sorted({0.95, *confidence_levels})
    boot = paired_bootstrap(control, candidate, n_resamples=n_resamples, seed=seed, confidences=levels)
    ci = {ci_key(c): (list(v) if v is not None else None) for c, v in boot.delta_rate_ci.items()}
    mal_ci = boot.delta_mean_acceptance_length_ci.get(0.95)
    divergence = compare_outputs(control, candidate, near_tie)
    return Comparison(
        delta_rate=boot.delta_rate,
        delta_rate_ci95=ci.get(ci_key(0.95)),
        delta_rate_ci=ci,
        delta_mean_acceptance_length=boot.delta_mean_acceptance_length,
        delta_mean_acceptance_length_ci95=list(mal_ci) if mal_ci is not None else None,
        target_outputs_identical=not divergence if control else None,
        output_divergence=divergence,
        near_tie_margin=near_tie,
        proposal_divergence=proposal_divergence(control, candidate),
        per_category=per_category(control, candidate),
        per_request_deltas=per_request_deltas(control, candidate),
        bootstrap={
            "unit": "request",
            "method": "paired percentile",
            "resamples": n_resamples,
            "seed": seed,
            "n_requests": boot.n_requests,
        },
    )


def compare_with_baseline(
    baseline: Sequence[RequestResult],
    tonight: Sequence[RequestResult],
    *,
    seed: int = 0,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence_levels: Sequence[float] = (0.95,),
) -> BaselineArm:
    """One arm of tonight against the same arm of a baseline run, paired by request id (tonight minus baseline)."""
    base, now, retokenized = pair_by_id(baseline, tonight)
    levels = sorted({0.95, *confidence_levels})
    boot = paired_bootstrap(base, now, n_resamples=n_resamples, seed=seed, confidences=levels)
    a, b = acceptance_summary(base), acceptance_summary(now)
    positions = per_position_deltas(base, now, n_resamples=n_resamples, seed=seed)
    moved = [d for d in per_request_deltas(base, now) if d["delta"]]
    moved.sort(key=lambda d: (-abs(d["delta"]), d["id"]))
    mal_ci = boot.delta_mean_acceptance_length_ci.get(0.95)
    return BaselineArm(
        compared=True,
        n_requests=len(now),
        retokenized=retokenized,
        baseline_rate=a.rate,
        tonight_rate=b.rate,
        baseline_mean_acceptance_length=a.mean_acceptance_length,
        tonight_mean_acceptance_length=b.mean_acceptance_length,
        delta_rate=boot.delta_rate,
        delta_rate_ci={ci_key(c): (list(v) if v is not None else None) for c, v in boot.delta_rate_ci.items()},
        delta_mean_acceptance_length=boot.delta_mean_acceptance_length,
        delta_mean_acceptance_length_ci95=list(mal_ci) if mal_ci is not None else None,
        per_position=[{"position": p["position"], "baseline": p["control"], "tonight": p["candidate"],
                       "delta": p["delta"], "ci": p["ci"]} for p in positions],
        per_category=[{"category": c["category"], "n": c["n"], "baseline_rate": c["control_rate"],
                       "tonight_rate": c["candidate_rate"], "delta": c["delta"]} for c in per_category(base, now)],
        moved=[{"id": d["id"], "category": d["category"], "baseline_rate": d["control_rate"],
                "tonight_rate": d["candidate_rate"], "delta": d["delta"]} for d in moved[:MOVED_REQUESTS]],
    )


def baseline_comparison(
    resolved: ResolvedBaseline,
    arms: dict[str, ArmResult],
    *,
    seed: int = 0,
    n_resamples: int = DEFAULT_RESAMPLES,
    confidence_levels: Sequence[float] = (0.95,),
    trend: Sequence[HistoryRun] = (),
) -> BaselineComparison:
    """Each of tonight's arms against the baseline's same arm, what differs between the runs, and the trend."""
    base = resolved.result
    compared = {}
    for name in ARMS:
        now, then = arms[name], base.arms[name]
        if not now.runnable or not then.runnable:
            which = "tonight's arm" if not now.runnable else "the baseline's arm"
            reason = now.not_runnable_reason if not now.runnable else then.not_runnable_reason
            compared[name] = BaselineArm(compared=False, reason=f"{which} did not run: {reason or 'no reason given'}")
        else:
            compared[name] = compare_with_baseline(then.per_request, now.per_request, seed=seed, n_resamples=n_resamples,
                                                   confidence_levels=confidence_levels)
    return BaselineComparison(
        ref=resolved.ref,
        chosen_by=resolved.chosen_by,
        history_id=resolved.history_id,
        result_path=str(resolved.path),
        created_at=base.created_at,
        configuration=configuration_of(base).describe(),
        differs=differences(base, {n: a.config for n, a in arms.items()}, {n: a.engine_version for n, a in arms.items()}),
        arms=compared,
        trend=[{"run_id": r.id, "created_at": r.created_at, "verdict": r.verdict, "control_rate": r.control_rate,
                "candidate_rate": r.candidate_rate, "baseline": r.id == resolved.history_id}
               for r in sorted(trend, key=lambda r: (r.created_at, r.id))],
        bootstrap={"unit": "request", "method": "paired percentile, matched by request id", "resamples": n_resamples,
                   "seed": seed},
    )


def build_result(
    corpus_info: CorpusInfo | Any,
    control: tuple[ArmConfig | dict, ArmRunInfo, Sequence[RequestResult]],
    candidate: tuple[ArmConfig | dict, ArmRunInfo, Sequence[RequestResult]],
    gate_rules: Gate | str | Path,
    seed: int,
    *,
    reproduce: str = "",
    n_resamples: int = DEFAULT_RESAMPLES,
    created_at: str | None = None,
    baseline: ResolvedBaseline | None = None,
    trend: Sequence[HistoryRun] = (),
) -> Result:
    """Summarise both arms, compare them (paired, bootstrapped) and with the baseline if given, evaluate the gate.

    trend: earlier runs of this configuration (history), shown beside the baseline."""
    gate = gate_rules if isinstance(gate_rules, Gate) else load_gate(gate_rules)
    corpus = corpus_info if isinstance(corpus_info, CorpusInfo) else CorpusInfo.from_corpus(corpus_info)
    ctrl, cand = arm_result(*control), arm_result(*candidate)
    if ctrl.runnable and cand.runnable:
        comparison = compare_arms(
            ctrl.per_request,
            cand.per_request,
            seed=seed,
            n_resamples=n_resamples,
            confidence_levels=confidences(gate),
            near_tie=near_tie_margin(gate),
        )
        # Keep both arms in the paired (control) order.
        order = {r.id: i for i, r in enumerate(ctrl.per_request)}
        cand.per_request.sort(key=lambda r: order[r.id])
    else:
        comparison = Comparison(near_tie_margin=near_tie_margin(gate))
    result = Result(
        corpus=corpus,
        control=ctrl,
        candidate=cand,
        comparison=comparison,
        gate=GateOutcome(passed=False, source=gate.source),
        created_at=created_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        reproduce=reproduce,
        seed=seed,
    )
    if baseline is not None:
        result.baseline = baseline_comparison(baseline, result.arms, seed=seed, n_resamples=n_resamples,
                                              confidence_levels=baseline_confidences(gate), trend=trend)
    result.gate = evaluate(gate, result)
    return result
