"""Build the Result of a run from both arms' engine output: summarise, compare (paired, bootstrapped), gate."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from qual.gate import Gate, confidences, evaluate, load_gate, near_tie_margin
from qual.records import ArmConfig, ArmRunInfo, RequestResult
from qual.result import ArmResult, Comparison, CorpusInfo, GateOutcome, Result, Throughput, ci_key
from qual.stats import (
    DEFAULT_NEAR_TIE_MARGIN,
    DEFAULT_RESAMPLES,
    acceptance_summary,
    compare_outputs,
    pair_requests,
    paired_bootstrap,
    per_category,
    per_request_deltas,
    proposal_divergence,
)


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
) -> Result:
    """Summarise both arms, compare them (paired, bootstrapped), evaluate the gate: the full Result."""
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
    result.gate = evaluate(gate, result)
    return result
