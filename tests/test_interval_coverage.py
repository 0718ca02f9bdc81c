"""Coverage of the rate and mean-acceptance-length delta intervals on synthetic populations whose delta is known
(bench/interval_coverage.py's populations and trials, fewer of them): each tail misses the truth about as often as
its confidence allows, at the sizes people run; the plain percentile interval qual used before does not."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
coverage = pytest.importorskip("interval_coverage")

POPULATION = 20_000
TRIALS = {8: 200, 16: 160, 64: 50, 164: 25}  # per scenario: most where the old interval failed; the bench: 2,000
NOMINAL = 0.025  # each tail of a 95% interval


def _allowed(trials: int, sigmas: float) -> float:
    return NOMINAL + sigmas * math.sqrt(NOMINAL * (1 - NOMINAL) / trials)


@pytest.fixture(scope="module")
def populations():
    return {s.name: coverage.population(s, POPULATION, seed=i) for i, s in enumerate(coverage.SCENARIOS.values())}


@pytest.fixture(scope="module")
def cells(populations):
    """{n: {scenario: Cell}} for both methods, on the same samples and resamples."""
    out: dict[int, dict] = {}
    for i, (name, pop) in enumerate(populations.items()):
        truth = coverage.truths(pop)
        for n, trials in TRIALS.items():
            out.setdefault(n, {})[name] = coverage.run_cell(pop, truth, n, trials, 2000, seed=100 * i + n)
    return out


def _pooled(by_scenario: dict, statistic: str, method: str) -> tuple[int, int, int]:
    tallies = [cell.tally(statistic, method) for cell in by_scenario.values()]
    return sum(t.trials for t in tallies), sum(t.low for t in tallies), sum(t.high for t in tallies)


@pytest.mark.parametrize("statistic", list(coverage.STATISTICS))
@pytest.mark.parametrize("n", list(TRIALS))
def test_each_tail_misses_as_often_as_the_confidence_allows(cells, n, statistic):
    for name, cell in cells[n].items():
        t = cell.tally(statistic, "qual")
        assert t.undefined == 0
        for tail in ("low", "high"):  # one scenario: loose (4 standard errors of its trials)
            assert t.tail(tail) <= _allowed(t.trials, 4), (name, n, tail, t)
    trials, low, high = _pooled(cells[n], statistic, "qual")
    for misses in (low, high):  # the four scenarios pooled: 3 standard errors
        assert misses / trials <= _allowed(trials, 3), (n, low, high, trials)
    # and not by being uselessly wide: two-sided coverage within 3 standard errors of 95% from above
    assert 1 - (low + high) / trials <= 0.95 + 3 * math.sqrt(0.95 * 0.05 / trials), (n, low, high, trials)


@pytest.mark.parametrize("n", [8])
def test_the_plain_percentile_interval_fails_the_same_test(cells, n):
    """The check above has teeth: the interval qual reported before lets its lower bound land above the truth too
    often at the sizes people run."""
    trials, low, high = _pooled(cells[n], "rate", "percentile")
    assert max(low, high) / trials > _allowed(trials, 3), (n, low, high, trials)


def test_the_populations_are_what_the_coverage_claims_rest_on(populations):
    pops = populations
    truth = {name: coverage.truths(p) for name, p in pops.items()}
    assert abs(truth["null"]["rate"]) < 0.003  # the null's delta is sampling noise of the population only
    assert -0.015 < truth["small"]["rate"] < -0.004 and truth["large"]["rate"] < -0.04
    for pop in pops.values():  # draft tokens are K x drafts, accepted tokens at most that (qual's records)
        assert np.array_equal(pop[:, 1], coverage.K * pop[:, 2]) and np.array_equal(pop[:, 4], coverage.K * pop[:, 5])
        assert np.all(pop[:, 0] <= pop[:, 1]) and np.all(pop[:, 3] <= pop[:, 4])
    drafts = np.sort(pops["skewed"][:, 2])[::-1]
    assert drafts[:len(drafts) // 20].sum() / drafts.sum() > 0.35  # a few long requests dominate the draft count
    flat = np.sort(pops["null"][:, 2])[::-1]
    assert flat[:len(flat) // 20].sum() / flat.sum() < 0.15
