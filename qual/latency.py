"""Latency of one arm: percentiles of its requests' time to first token, time per output token and end-to-end
latency, its decode rate, and the cost of a decode step (pure functions, docs/statistics.md "Latency").

Every number comes from the requests' latency records (records.RequestLatency); an arm without them has no summary.
"""

from __future__ import annotations

from typing import Sequence

from typing_extensions import TypedDict  # as qual.records says

import numpy as np

from qual.records import RequestResult

PERCENTILES = (50, 90, 99)
# numpy.percentile's default: linear interpolation between the two closest ranks (Hyndman and Fan's type 7)
PERCENTILE_METHOD = "linear"


class Percentiles(TypedDict):
    """One latency over the arm's requests that have it: how many, their mean, and p50 / p90 / p99."""

    n: int
    """The requests that have this latency [count]"""
    mean: float | None
    """Their mean [seconds]"""
    p50: float | None
    """The median [seconds]"""
    p90: float | None
    """The 90th percentile [seconds]"""
    p99: float | None
    """The 99th percentile [seconds]"""


class LatencySummary(TypedDict):
    """One arm's latency (result.json arms.<arm>.latency), in seconds."""

    ttft_s: Percentiles
    """Time to first token"""
    tpot_s: Percentiles
    """Time per output token after the first"""
    e2e_s: Percentiles
    """End-to-end latency"""
    queued_s: Percentiles
    """Arrival to admission, where the engine schedules requests itself"""
    decode_tokens_per_second: float | None
    """Sum of (tokens - 1) / sum of (last token - first token), over the requests [tokens/s]"""
    step_s: float | None
    """A decode step: sum of decode_steps_s / sum of (steps - 1), over the requests [seconds]"""
    decode_steps: int
    """The steps step_s averages over: each request's steps after its first token, summed [count]"""
    percentile_method: str
    """numpy.percentile's method (linear)"""


def percentiles(values: Sequence[float]) -> Percentiles:
    """n, mean and PERCENTILES of the values (numpy's linear interpolation); None for each where there are none."""
    if not values:
        return Percentiles(n=0, mean=None, p50=None, p90=None, p99=None)
    x = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = (float(v) for v in np.percentile(x, PERCENTILES, method=PERCENTILE_METHOD))
    return Percentiles(n=len(values), mean=float(x.mean()), p50=p50, p90=p90, p99=p99)


def decode_span(r: RequestResult) -> tuple[int, float, int, float] | None:
    """A request's decode: tokens after its first, seconds from its first token to its last, the steps that brought
    them and the seconds those steps took; None where it has one token or no step times (an unstreamed reply, an
    older result)."""
    lat = r.latency
    steps = lat["step_times_s"] if lat else []
    if len(r.output_token_ids) < 2 or len(steps) < 2:
        return None
    return len(r.output_token_ids) - 1, steps[-1] - steps[0], len(steps) - 1, lat["decode_steps_s"]


def latency_summary(requests: Sequence[RequestResult]) -> LatencySummary | None:
    """The arm's summary; None where no request carries a latency record."""
    timed = [r.latency for r in requests if r.latency is not None]
    if not timed:
        return None

    def of(key: str) -> Percentiles:
        return percentiles([lat[key] for lat in timed if lat[key] is not None])

    spans = [s for s in map(decode_span, requests) if s is not None]
    tokens, seconds, steps, in_steps = (sum(col) for col in zip(*spans)) if spans else (0, 0.0, 0, 0.0)
    return LatencySummary(ttft_s=of("ttft_s"), tpot_s=of("tpot_s"), e2e_s=of("e2e_s"), queued_s=of("queued_s"),
                          decode_tokens_per_second=tokens / seconds if seconds > 0 else None,
                          step_s=in_steps / steps if steps else None, decode_steps=steps,
                          percentile_method=PERCENTILE_METHOD)
