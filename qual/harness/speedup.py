"""`qual run --speedup`: what speculation buys. The candidate against its own configuration without the drafter
(plain decoding), paired per request: decode tokens/s of both, their ratio with a paired-bootstrap interval, and the
acceptance-implied bound; and the batch's throughput in both, and whether the two ratios agree in direction
(docs/statistics.md "Speedup")."""

from __future__ import annotations

from dataclasses import replace

from qual.intervals import METHOD
from qual.records import ArmConfig
from qual.result import ArmResult, SpeculativeAndPlain, Speedup, StepSeconds
from qual.stats import DEFAULT_RESAMPLES, compare_outputs, decode_speedup, pair_requests

PLAIN_ARM = "plain"  # the third arm's name: its journal, arm record and progress line


def plain_arm(candidate: ArmConfig) -> ArmConfig:
    """The candidate's configuration without the drafter: the same target, parallel layout, engine and sampling."""
    return replace(candidate, draft_path=None, num_speculative_tokens=0)


def _step_s(arm: ArmResult) -> float | None:
    return (arm.latency or {}).get("step_s")


def speedup(candidate: ArmResult, plain: ArmResult, *, seed: int = 0, n_resamples: int = DEFAULT_RESAMPLES) -> Speedup:
    """The comparison; `plain.per_request` is put in the candidate's order. Where either arm did not run, only what
    each arm measured on its own is filled in."""
    ran = candidate.runnable and plain.runnable and bool(candidate.per_request)
    identical = None
    if ran:
        spec_rows, plain.per_request = pair_requests(candidate.per_request, plain.per_request)
        interval = decode_speedup(spec_rows, plain.per_request, n_resamples=n_resamples, seed=seed)
        identical = not compare_outputs(spec_rows, plain.per_request)
    mal = candidate.acceptance.mean_acceptance_length
    spec_step, plain_step = _step_s(candidate), _step_s(plain)
    bound = mal * plain_step / spec_step if mal is not None and plain_step and spec_step else None
    ci = interval.ratio_ci.get(0.95) if ran else None
    batch = SpeculativeAndPlain(speculative=candidate.throughput.generate_tokens_per_second,
                                plain=plain.throughput.generate_tokens_per_second)
    batch_ratio = batch["speculative"] / batch["plain"] if batch["speculative"] and batch["plain"] else None
    ratio = interval.ratio if ran else None
    return Speedup(
        plain=plain,
        decode_tokens_per_second=SpeculativeAndPlain(speculative=interval.speculative_rate if ran else None,
                                                     plain=interval.plain_rate if ran else None),
        ratio=ratio,
        ratio_ci95=list(ci) if ci is not None else None,
        n_requests=interval.n_requests if ran else 0,
        mean_acceptance_length=mal,
        step_s=StepSeconds(speculative=spec_step, plain=plain_step),
        bound=bound,
        generate_tokens_per_second=batch,
        target_outputs_identical=identical,
        bootstrap={"unit": "request", "method": f"paired {METHOD} of the ratio of sums", "resamples": n_resamples,
                   "seed": seed, "n_requests": interval.n_requests if ran else 0},
        batch_ratio=batch_ratio,
        directions_agree=(ratio >= 1) == (batch_ratio >= 1) if ratio is not None and batch_ratio is not None else None,
    )
