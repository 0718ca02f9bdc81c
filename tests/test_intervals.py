"""The interval method every reported interval uses (qual.intervals): Student's t, the kurtosis-adjusted degrees of
freedom, the expanded tails, the resamples; its coverage is tests/test_interval_coverage.py's."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from qual.intervals import (
    MIN_UNITS,
    bounds,
    bounds_of_each,
    effective_df,
    estimate,
    resample,
    small_sample_note,
    student_t_cdf,
    student_t_quantile,
    tail_probability,
)

# Two-sided critical values of Student's t as printed in statistical tables (3 decimals): df -> {p: t_p}.
T_TABLE = {
    1: {0.95: 6.314, 0.975: 12.706, 0.995: 63.657},
    2: {0.95: 2.920, 0.975: 4.303, 0.995: 9.925},
    5: {0.95: 2.015, 0.975: 2.571, 0.995: 4.032},
    7: {0.95: 1.895, 0.975: 2.365, 0.995: 3.499},
    10: {0.95: 1.812, 0.975: 2.228, 0.995: 3.169},
    30: {0.95: 1.697, 0.975: 2.042, 0.995: 2.750},
    120: {0.95: 1.658, 0.975: 1.980, 0.995: 2.617},
}


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_student_t_quantiles_are_the_printed_tables(df):
    for p, t in T_TABLE[df].items():
        assert student_t_quantile(p, df) == pytest.approx(t, abs=6e-4)
        assert student_t_quantile(1 - p, df) == pytest.approx(-t, abs=6e-4)


def _cdf_by_quadrature(t: float, df: int) -> float:
    """0.5 + the integral of Student's density from 0 to t (Simpson's rule): a second derivation of the CDF."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    x = np.linspace(0.0, t, 40_001)
    f = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    h = x[1] - x[0]
    return 0.5 + h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 63, 163, 999, 1000, 1001, 5000])
def test_student_t_cdf_and_quantile_agree_with_the_density_integrated(df):
    for t in (0.3, 1.0, 2.0, 3.5):
        assert student_t_cdf(t, df) == pytest.approx(_cdf_by_quadrature(t, df), abs=1e-10)
        assert student_t_cdf(-t, df) == pytest.approx(1 - student_t_cdf(t, df), abs=1e-14)
    for p in (0.6, 0.9, 0.975, 0.995):  # above 1000 df the quantile is the expansion: held to the integral too
        assert _cdf_by_quadrature(student_t_quantile(p, df), df) == pytest.approx(p, abs=1e-10)
    assert student_t_quantile(0.975, df) > NormalDist().inv_cdf(0.975)  # heavier tails than the normal's


def test_student_t_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="degrees of freedom"):
        student_t_quantile(0.9, 0)
    with pytest.raises(ValueError, match="probability"):
        student_t_quantile(1.0, 5)
    with pytest.raises(ValueError, match="degrees of freedom"):
        student_t_cdf(1.0, 0)


def test_effective_df_falls_where_a_few_units_carry_the_statistic():
    rng = np.random.default_rng(0)
    assert effective_df(rng.normal(size=400)) >= 300  # normal values: about n (held to n - 1)
    assert effective_df(np.array([1.0, -1.0] * 10)) == 19  # no tail at all
    # one unit of 20 moves the statistic: kurtosis 18.05 -> floor(40 / 17.05)
    assert effective_df(np.array([0.0] * 19 + [1.0])) == 2
    assert effective_df(np.full(12, 0.3)) == 11  # no spread: nothing says the tails are heavy
    assert effective_df(np.array([0.1, np.nan, 0.2])) == 1  # leaving one unit out leaves the statistic undefined
    assert effective_df(np.array([0.5])) == 1


def test_tail_probability_is_the_expanded_percentile_and_shrinks_with_the_degrees_of_freedom():
    for n in (2, 5, 8, 16, 164):
        hesterberg = NormalDist().cdf(-math.sqrt(n / (n - 1)) * student_t_quantile(0.975, n - 1))
        assert tail_probability(0.95, n, n - 1) == pytest.approx(hesterberg, rel=1e-12)
    assert tail_probability(0.95, 8, 7) == pytest.approx(0.00573, abs=1e-5)  # 2.365 x sqrt(8 / 7) standard errors
    tails = [tail_probability(0.95, 40, df) for df in (39, 20, 5, 1)]
    assert tails == sorted(tails, reverse=True) and tails[-1] < 1e-9
    assert tail_probability(0.95, 10**6, 10**6 - 1) == pytest.approx(0.025, abs=1e-5)
    assert tail_probability(0.9, 30, 29) > tail_probability(0.95, 30, 29)
    assert tail_probability(0.95, 1, 1) == 0.0  # one unit: every resample is it


def test_bounds_move_with_the_statistic_and_nest_by_confidence():
    rng = np.random.default_rng(1)
    resampled, left_out = rng.gamma(2.0, size=2000), rng.gamma(2.0, size=12)
    lo, hi = bounds(resampled, left_out, 0.95)
    assert lo < np.median(resampled) < hi
    # affine maps: the percentiles move with the values, the kurtosis does not; a negative scale swaps the ends
    assert bounds(3 * resampled - 1, 3 * left_out - 1, 0.95) == pytest.approx((3 * lo - 1, 3 * hi - 1), rel=1e-12)
    assert bounds(-resampled, -left_out, 0.95) == pytest.approx((-hi, -lo), rel=1e-12)
    lo90, hi90 = bounds(resampled, left_out, 0.9)
    assert lo < lo90 < hi90 < hi
    # a heavy jackknife tail widens the interval on the same resamples
    heavy = np.concatenate([np.zeros(11), [1.0]])
    wide = bounds(resampled, heavy, 0.95)
    assert wide[0] < lo and wide[1] > hi
    assert bounds(np.full(2000, 0.25), np.full(12, 0.25), 0.95) == (0.25, 0.25)
    assert bounds(np.full(100, np.nan), left_out, 0.95) is None
    both = bounds_of_each(np.stack([resampled, 3 * resampled - 1], axis=1), np.stack([left_out, 3 * left_out - 1], 1),
                          0.95)
    assert both[0] == (lo, hi) and both[1] == pytest.approx((3 * lo - 1, 3 * hi - 1), rel=1e-12)


def test_resample_is_seeded_and_its_sums_are_exact():
    columns = np.arange(30, dtype=np.float64).reshape(10, 3) ** 2
    a, b, c = resample(columns, 300, seed=4), resample(columns, 300, seed=4), resample(columns, 300, seed=5)
    assert np.array_equal(a.resampled, b.resampled) and not np.array_equal(a.resampled, c.resampled)
    assert np.array_equal(a.total, columns.sum(axis=0, keepdims=True))
    assert np.array_equal(a.left_out, columns.sum(axis=0) - columns) and a.n_units == 10
    assert np.array_equal(a.resampled, np.round(a.resampled))  # counts x integers: no rounding
    # each resample draws 10 units: its sums lie between 10 x the smallest and 10 x the largest row
    assert np.all(a.resampled >= 10 * columns.min(axis=0)) and np.all(a.resampled <= 10 * columns.max(axis=0))
    assert resample(np.zeros((0, 3)), 50).resampled.shape == (0, 3)


def test_estimate_of_a_ratio_of_sums():
    columns = np.array([[3.0, 10.0], [5.0, 10.0], [1.0, 10.0], [4.0, 10.0], [6.0, 10.0], [2.0, 10.0]])
    def ratio(s):
        with np.errstate(invalid="ignore"):
            return s[:, 0] / s[:, 1]

    sums = resample(columns, 2000, seed=0)
    value, interval = estimate(sums, ratio, 0.95)
    assert value == pytest.approx(21 / 60)
    assert 0.1 <= interval[0] < value < interval[1] <= 0.6  # never past the units' own ratios
    assert estimate(resample(np.zeros((3, 2)), 10), ratio, 0.95) == (None, None)


def test_the_small_sample_note_names_the_units_below_the_threshold_only():
    assert small_sample_note(MIN_UNITS) is None and small_sample_note(None) is None
    assert small_sample_note(MIN_UNITS - 1).startswith(f"{MIN_UNITS - 1} requests: below {MIN_UNITS} ")
    assert small_sample_note(1, "conversation").startswith("1 conversation: ")
    assert "docs/statistics.md" in small_sample_note(2)


def test_every_interval_comes_from_qual_intervals():
    """One method for every interval: no other module of qual takes percentiles or quantiles of resamples (latency's
    are percentiles of measured seconds, not an interval)."""
    import re
    from pathlib import Path

    import qual

    root = Path(qual.__file__).parent
    allowed = {root / "intervals.py", root / "latency.py"}
    found = [str(path.relative_to(root)) for path in root.rglob("*.py") if path not in allowed
             and re.search(r"\b(?:nan)?(?:percentile|quantile)\s*\(", path.read_text())]
    assert found == [], found
