"""Build the Result of a run from both arms' engine output: summarise, compare (paired, bootstrapped), gate."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import qual
from qual.baseline import ARMS, BaselineArm, BaselineComparison
from qual.gate import Gate, baseline_confidences, confidences, evaluate, load_gate, near_tie_margin
from qual.harness.baseline import ResolvedBaseline, differences
from qual.history import HistoryRun, configuration_of, recorded_order
from qual.harness.inputs import checkpoint_records
from qual.intervals import METHOD
from qual.harness.speedup import speedup
from qual.latency import latency_summary
from qual.nights import changes, facts_of
from qual.provenance import local_host, qual_commit
from qual.records import ArmConfig, ArmRunInfo, EngineBuild, RequestResult
from qual.result import ArmResult, Comparison, CorpusInfo, GateOutcome, Provenance, Result, Throughput, ci_key
from qual.stats import (
    DEFAULT_NEAR_TIE_MARGIN,
    DEFAULT_RESAMPLES,
    acceptance_summary,
    compare_outputs,
    earlier_turns_differ,
    pair_by_id,
    pair_requests,
    paired_bootstrap,
    per_category,
    per_request_deltas,
    per_turn,
    proposal_divergence,
)

MOVED_REQUESTS = 10  # requests listed per arm as having moved most against the baseline


def provenance(config: dict, info: ArmRunInfo, corpus_fingerprint: str, gate_sha256: str | None) -> Provenance:
    """One arm's provenance, collected where qual runs; the engine's own build and host come from the engine.
    gate_sha256: the digest of the gate file as it was read (qual.gate_rules.Gate.sha256), not as it is now."""
    commit, dirty = qual_commit()
    return Provenance(
        qual_version=qual.__version__, qual_commit=commit, qual_checkout_dirty=dirty, host=local_host(),
        engine=info.build or EngineBuild(name=str(config.get("engine")), version=info.engine_version,
                                         source="the engine reported no build facts"),
        corpus_fingerprint=corpus_fingerprint,
        gate_sha256=gate_sha256,
        checkpoints=checkpoint_records(config),
        chat_template=(config.get("extra") or {}).get("chat_template"),
    )


def _gpu_type(p: Provenance) -> str | None:
    """The GPU model(s) the engine ran on; "CPU" where it ran on none; None where nothing says."""
    host = p.engine.host
    if host is None:
        return None
    return ", ".join(sorted(set(host.gpus))) if host.gpus else "CPU"


def _checkpoint(arm: ArmResult, role: str) -> str | None:
    """The checkpoint an arm ran as its target or draft: its recorded identity (the files' digest), else its path."""
    checkpoints = arm.provenance.checkpoints if arm.provenance is not None else None
    record = checkpoints.get(role) if checkpoints else None
    if record and record.get("identity", "").startswith(("sha256:", "hub:")):
        return record["identity"]
    return arm.config.get(f"{role}_path")


def checkpoint_differences(control: ArmResult, candidate: ArmResult) -> list[str]:
    """The arms ran other targets or drafters (qual compare joins arms of any two runs): one line each."""
    out = []
    for role, name in (("target", "target"), ("draft", "drafter")):
        ca, cb = _checkpoint(control, role), _checkpoint(candidate, role)
        if ca != cb:
            ma, mb = control.config.get("model", "?"), candidate.config.get("model", "?")
            out.append(f"{name} differs: control {ma} ({ca}), candidate {mb} ({cb})")
    return out


def provenance_differences(control: ArmResult, candidate: ArmResult) -> list[str]:
    """Differences between two arms that change what acceptance or speed mean, one line each: the target or drafter
    checkpoint, engine version, dtype, numerics, GPU type (unknown on either side is not a difference)."""
    a, b = control.provenance, candidate.provenance
    if a is None or b is None:
        missing = [name for name, p in (("control", a), ("candidate", b)) if p is None]
        return [f"provenance not recorded for the {' and '.join(missing)} arm (a result written before qual recorded it)"]
    out = checkpoint_differences(control, candidate)
    (na, va), (nb, vb) = (a.engine.name, a.engine.version), (b.engine.name, b.engine.version)
    if na != nb:
        out.append(f"engine differs: control {na} {va or '(version unknown)'}, candidate {nb} {vb or '(version unknown)'}")
    elif va and vb and va != vb:
        out.append(f"engine version differs: control {va}, candidate {vb}")
    da, db = control.config.get("dtype"), candidate.config.get("dtype")
    if da != db:
        out.append(f"dtype differs: control {da}, candidate {db}")
    na, nb = control.config.get("numerics"), candidate.config.get("numerics")
    if na != nb:
        out.append(f"numerics differ: control {na or 'not chosen'}, candidate {nb or 'not chosen'}")
    ga, gb = _gpu_type(a), _gpu_type(b)
    if ga and gb and ga != gb:
        out.append(f"GPU type differs: control {ga}, candidate {gb}")
    return out


def arm_result(config: ArmConfig | dict, info: ArmRunInfo, requests: Sequence[RequestResult],
               prov: Provenance | None = None) -> ArmResult:
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
        provenance=prov,
        extra=dict(info.extra),
        latency=latency_summary(requests),
    )


def resampling_unit(rows: Sequence[RequestResult]) -> str:
    """What the paired bootstrap resamples: a conversation's turns together where the requests hold conversations."""
    return "conversation" if any(r.conversation for r in rows) else "request"


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
        per_position=boot.per_position,
        per_turn=per_turn(control, candidate),
        earlier_turns_differ=earlier_turns_differ(control, candidate),
        bootstrap={
            "unit": resampling_unit(control),
            "method": f"paired {METHOD}",
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
    """One arm of tonight against the same arm of a baseline run, paired by request id (tonight minus baseline), on
    the requests both ran (a baseline of another selection of the corpus holds fewer, or more)."""
    ran = {r.id for r in baseline}
    common = [r for r in tonight if r.id in ran]
    base, now, retokenized = pair_by_id(baseline, common)
    levels = sorted({0.95, *confidence_levels})
    boot = paired_bootstrap(base, now, n_resamples=n_resamples, seed=seed, confidences=levels)
    a, b = acceptance_summary(base), acceptance_summary(now)
    moved = [d for d in per_request_deltas(base, now) if d["delta"]]
    moved.sort(key=lambda d: (-abs(d["delta"]), d["id"]))
    mal_ci = boot.delta_mean_acceptance_length_ci.get(0.95)
    return BaselineArm(
        compared=True,
        n_requests=len(now),
        not_in_baseline=len(tonight) - len(common),
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
                       "delta": p["delta"], "ci": p["ci"]} for p in boot.per_position],
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
    tonight: Result | None = None,
    axis: str = "date",
) -> BaselineComparison:
    """Each of tonight's arms against the baseline's same arm, what differs between the runs (their configs, and what
    changed beside them: engine, torch, qual), and the trend (each night with what every axis needs; drawn along
    axis)."""
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
        forced=resolved.forced,
        key_differences=[{"key": k, "tonight": t, "baseline": b} for k, t, b in resolved.key_differences],
        differs=differences(base, {n: a.config for n, a in arms.items()}, {n: a.engine_version for n, a in arms.items()}),
        changed=changes(facts_of(base), facts_of(tonight)) if tonight is not None else [],
        arms=compared,
        trend=[{"run_id": r.id, "created_at": r.created_at, "verdict": r.outcome, "control_rate": r.control_rate,
                "candidate_rate": r.candidate_rate, "baseline": r.id == resolved.history_id,
                "engine": r.facts.get("engine"), "qual": r.facts.get("qual"), "meta": dict(r.meta)}
               for r in sorted(trend, key=recorded_order) if not r.is_error],
        axis=axis,
        bootstrap={"unit": resampling_unit([r for a in arms.values() for r in a.per_request]),
                   "method": f"paired {METHOD}, matched by request id", "resamples": n_resamples, "seed": seed},
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
    provenances: tuple[Provenance | None, Provenance | None] | None = None,
    plain: tuple[ArmConfig | dict, ArmRunInfo, Sequence[RequestResult]] | None = None,
    meta: dict[str, str] | None = None,
    first_night: bool = False,
    axis: str = "date",
) -> Result:
    """Summarise both arms, compare them (paired, bootstrapped) and with the baseline if given, evaluate the gate.

    trend: earlier runs of this configuration (history), shown beside the baseline. Each arm's provenance is
    collected here unless given (`qual compare` keeps what the earlier runs recorded). plain (`--speedup`): the
    candidate's configuration without the drafter, compared with the candidate (it decides nothing in the gate).
    meta: the night's --meta labels; first_night: history:last-pass found nothing to compare with (the gate's
    baseline rules are skipped, saying so); axis: what the report's strip of the trend runs along (--axis).
    """
    gate = gate_rules if isinstance(gate_rules, Gate) else load_gate(gate_rules)
    corpus = corpus_info if isinstance(corpus_info, CorpusInfo) else CorpusInfo.from_corpus(corpus_info)
    if provenances is None:
        provenances = tuple(provenance(_config_json(c), i, corpus.fingerprint, gate.sha256) for c, i, _ in (control, candidate))
    ctrl, cand = arm_result(*control, provenances[0]), arm_result(*candidate, provenances[1])
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
        warnings=provenance_differences(ctrl, cand),
        meta=dict(meta or {}),
        first_night=first_night and baseline is None,
    )
    if plain is not None:
        arm = arm_result(*plain, provenance(_config_json(plain[0]), plain[1], corpus.fingerprint, gate.sha256))
        result.speedup = speedup(cand, arm, seed=seed, n_resamples=n_resamples)
    if baseline is not None:
        result.baseline = baseline_comparison(baseline, result.arms, seed=seed, n_resamples=n_resamples,
                                              confidence_levels=baseline_confidences(gate), trend=trend,
                                              tonight=result, axis=axis)
    result.gate = evaluate(gate, result)
    return result


def _config_json(config: ArmConfig | dict) -> dict:
    return config.to_json() if isinstance(config, ArmConfig) else dict(config)
