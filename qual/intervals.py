"""Confidence intervals of statistics of column sums over resampling units (requests, or conversations), from a
paired bootstrap: the one method behind every interval qual reports (docs/statistics.md "Intervals").

A statistic here is a function of the column sums of a [units, columns] matrix (a ratio of sums, a difference or a
quotient of two), evaluated row-wise on sums: [rows, columns] -> [rows] (or [rows, m] for m statistics at once),
NaN where a denominator is 0. Each is evaluated on three kinds of sums: over all units (the point estimate), over
each bootstrap resample (the same resampled units for every statistic), and over all units but one (the jackknife).

The interval is the expanded percentile interval, its expansion widened further where the jackknife shows that a
few units carry the statistic (docs/statistics.md "Intervals" says why, and how well it covers):

1. nu = 2n / (kurtosis of the n jackknife values - 1), floored and held to [1, n - 1]: the degrees of freedom of a
   variance estimated from n values of that kurtosis (n - 1 for normal values, fewer where a few dominate; 1 where
   leaving one unit out leaves the statistic undefined);
2. each tail's probability a = Phi(-sqrt(n / (n - 1)) * t_nu(1 - (1 - confidence) / 2)): the percentile interval
   is a normal interval on the resamples' spread, which divides by n; this makes it a t interval on nu degrees of
   freedom with the spread divided by n - 1 (Hesterberg's expanded percentile interval when nu = n - 1);
3. (lo, hi): the a and 1 - a percentiles of the statistic over the resamples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable, NamedTuple

import numpy as np

METHOD = "expanded percentile (kurtosis-adjusted)"  # result.json's bootstrap.method names it
DEFAULT_RESAMPLES = 2000
# Below this many resampling units the intervals cover less than their confidence (docs/statistics.md "Coverage",
# bench/interval_coverage.py): runs say so beside the verdict.
MIN_UNITS = 7
# Bounds the [resamples, units] index matrix built at once.
_MAX_CHUNK_ELEMENTS = 4_000_000

Statistic = Callable[[np.ndarray], np.ndarray]  # column sums [rows, columns] -> [rows] or [rows, m]; NaN: undefined


class Estimate(NamedTuple):
    """A statistic's point estimate over all units and its (lo, hi) interval at one confidence; None: undefined."""

    value: float | None
    bounds: tuple[float, float] | None


@dataclass(frozen=True)
class Resamples:
    """The column sums a statistic is evaluated on: over all units, over each bootstrap resample, over all units but
    one (row i leaves unit i out)."""

    total: np.ndarray  # [1, columns]
    resampled: np.ndarray  # [resamples, columns]
    left_out: np.ndarray  # [units, columns]

    @property
    def n_units(self) -> int:
        return self.left_out.shape[0]


def resample(columns: np.ndarray, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Resamples:
    """The sums of `columns` ([units, columns]) over all units, over `n_resamples` bootstrap resamples of the rows and
    over each leave-one-out subset.

    The unit indices drawn depend only on (units, resamples, seed): the same seed gives the same resamples to every
    statistic computed from them, and to both arms of a paired comparison (their columns share a row).
    """
    n = columns.shape[0]
    rng = np.random.default_rng(seed)
    chunk = max(1, _MAX_CHUNK_ELEMENTS // max(n, 1))
    sums = []
    for start in range(0, n_resamples if n else 0, chunk):
        idx = rng.integers(0, n, size=(min(chunk, n_resamples - start), n))  # [resamples, units]
        rows = idx.shape[0]
        # How often each unit was drawn into each resample; counts times integer columns sum exactly in float64.
        drawn = np.bincount((idx + n * np.arange(rows)[:, None]).ravel(), minlength=rows * n).reshape(rows, n)
        sums.append(drawn.astype(np.float64) @ columns)  # [resamples, columns]
    total = columns.sum(axis=0, keepdims=True)
    resampled = np.concatenate(sums) if sums else np.zeros((0, columns.shape[1]))
    return Resamples(total=total, resampled=resampled, left_out=total - columns)


def estimate(resamples: Resamples, statistic: Statistic, confidence: float) -> Estimate:
    """One statistic's point estimate and its interval at `confidence` (the method of this module's docstring)."""
    value = float(statistic(resamples.total)[0])
    if not math.isfinite(value):
        return Estimate(None, None)
    return Estimate(value, bounds(statistic(resamples.resampled), statistic(resamples.left_out), confidence))


def bounds(resampled: np.ndarray, left_out: np.ndarray, confidence: float) -> tuple[float, float] | None:
    """(lo, hi) at `confidence` of one statistic from its values on the resamples [resamples] and with each unit left
    out [units]; None where no resample defines it."""
    return bounds_of_each(resampled[:, None], left_out[:, None], confidence)[0]


def bounds_of_each(resampled: np.ndarray, left_out: np.ndarray, confidence: float) -> list[tuple[float, float] | None]:
    """bounds() of m statistics at once: their values on the resamples [resamples, m] and with each unit left out
    [units, m]."""
    n = left_out.shape[0]
    tails: dict[int, float] = {}  # degrees of freedom -> tail probability, computed once per call
    out: list[tuple[float, float] | None] = []
    for j in range(resampled.shape[1]):
        finite = resampled[:, j][np.isfinite(resampled[:, j])]
        if finite.size == 0:
            out.append(None)
            continue
        df = effective_df(left_out[:, j])
        if df not in tails:
            tails[df] = tail_probability(confidence, n, df)
        lo, hi = np.percentile(finite, [100.0 * tails[df], 100.0 * (1.0 - tails[df])])
        out.append((float(lo), float(hi)))
    return out


def effective_df(left_out: np.ndarray) -> int:
    """Degrees of freedom of the spread of n units, from the kurtosis of the statistic's n jackknife values:
    2n / (kurtosis - 1) (a variance from n normal values has n; heavy tails have fewer), held to [1, n - 1]; 1 where
    leaving a unit out leaves the statistic undefined (that unit alone carries a denominator)."""
    n = left_out.shape[0]
    if n < 2:
        return 1
    if not np.all(np.isfinite(left_out)):
        return 1
    d = left_out - left_out.mean()
    square = float(np.sum(d * d))
    if square <= 0.0:
        return n - 1
    kurtosis = n * float(np.sum(d ** 4)) / (square * square)
    if kurtosis <= 1.0:  # every value equally far from the mean: no tail at all
        return n - 1
    return int(min(n - 1, max(1, math.floor(2.0 * n / (kurtosis - 1.0)))))


def tail_probability(confidence: float, n_units: int, df: int) -> float:
    """Each tail's probability the percentiles are taken at: Phi(-sqrt(n / (n - 1)) * t_df(1 - alpha / 2)), alpha =
    1 - confidence; 0 for one unit (every resample is that unit: the interval is its value)."""
    if n_units < 2:
        return 0.0
    t = student_t_quantile(1.0 - (1.0 - confidence) / 2.0, df)
    return NormalDist().cdf(-math.sqrt(n_units / (n_units - 1)) * t)


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t on an integer number of degrees of freedom (Abramowitz and Stegun 26.7.3-4)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    c2 = c * c
    if df % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), ending at cos^(df - 3)
        if df == 1:
            return 0.5 + theta / math.pi
        term = series = 1.0
        for k in range(3, df - 1, 2):
            term *= c2 * (k - 1) / k
            series += term
        return 0.5 + (theta + s * c * series) / math.pi
    term = series = 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), ending at cos^(df - 2)
    for k in range(2, df - 1, 2):
        term *= c2 * (k - 1) / k
        series += term
    return 0.5 + 0.5 * s * series


# Above this many degrees of freedom the quantile is the Cornish-Fisher expansion about the normal's (error of order
# df^-4: below 1e-11 here) instead of Newton's method on a series of df / 2 terms.
_EXPANSION_DF = 1000


def student_t_quantile(p: float, df: int) -> float:
    """t with P(T <= t) = p on `df` degrees of freedom (Newton's method on student_t_cdf, from the normal quantile)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile's probability must lie in (0, 1), got {p}")
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    z = NormalDist().inv_cdf(p)
    if df > _EXPANSION_DF:
        z2 = z * z
        return z * (1 + (z2 + 1) / (4 * df) + (5 * z2 * z2 + 16 * z2 + 3) / (96 * df ** 2)
                    + (3 * z2 ** 3 + 19 * z2 * z2 + 17 * z2 - 15) / (384 * df ** 3))
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    t = z  # below the root: the t CDF is concave above 0, so Newton's steps climb to the root from below
    for _ in range(200):
        density = math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))
        step = (p - student_t_cdf(t, df)) / density
        t += step
        if abs(step) <= 1e-12 * max(1.0, abs(t)):
            break
    return t


def small_sample_note(n_units: int | None, unit: str = "request") -> str | None:
    """The line a run shows beside its verdict where its intervals rest on fewer than MIN_UNITS resampling units;
    None otherwise (or where the count is not known)."""
    if n_units is None or n_units >= MIN_UNITS:
        return None
    return (f"{n_units} {unit}{'' if n_units == 1 else 's'}: below {MIN_UNITS} the intervals cover less than their "
            f"stated confidence (docs/statistics.md, \"Coverage\"), so the gate's bounds are not to be trusted; "
            f"replay more {unit}s")
