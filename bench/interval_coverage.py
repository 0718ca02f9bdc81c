"""How often qual's 95% intervals of the acceptance-rate and mean-acceptance-length deltas contain the true delta, on
synthetic request populations whose delta is known; beside them the plain percentile interval qual used before, on
the same resamples (docs/statistics.md "Coverage").

    .venv/bin/python bench/interval_coverage.py [--trials 2000] [--sizes 2,3,4,5,6,7,8,16,32,64,164]
        [--population 200000] [--resamples 2000] [--scenarios null,small,large,skewed] [--seed 0]

Each trial draws --sizes requests with replacement from a population of --population requests, computes each
interval from --resamples paired resamples (qual.intervals, as `qual run` does) and records whether its lower bound
lies above the population's delta, or its upper bound below it. The population's delta is its ratio of sums over
every request. A request of the population (population()): per-token acceptance p from a Beta(4, 2) law; each draft
accepts a chain of the K = 7 positions, position i only if i - 1 was, each with probability p; an arm makes a
Poisson number of drafts, as many as its output length takes at its mean accepted length; the candidate's p is the
control's shifted by a normal amount per request. Output lengths are 64 tokens, or in the skewed population
lognormal (median 64, sigma 1.5, at most 4096), so that the longest 5% of requests hold 44% of the drafts.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from qual.intervals import DEFAULT_RESAMPLES, MIN_UNITS, bounds, resample, student_t_quantile
from qual.stats import PAIRED_COLUMNS, delta_mean_acceptance_length_of, delta_rate_of

K = 7
CONFIDENCE = 0.95
STATISTICS = {"rate": delta_rate_of, "mean acceptance length": delta_mean_acceptance_length_of}
METHODS = ("percentile", "qual")  # the interval qual used before (kept here only to compare), and qual's


@dataclass(frozen=True)
class Scenario:
    """A population of requests: how the candidate's per-token acceptance differs from the control's, per request,
    and how long the requests are."""

    name: str
    description: str
    shift_mean: float  # candidate p - control p, per request: a normal law's mean
    shift_sd: float  # ... and its standard deviation (0 with mean 0: both arms draw from the same law)
    length_sigma: float = 0.0  # lognormal sigma of output lengths (median 64); 0: every request 64 tokens


SCENARIOS = {s.name: s for s in (
    Scenario("null", "no change (the candidate's p is the control's)", 0.0, 0.0),
    Scenario("small", "small regression (p shifted by N(-0.01, 0.02) per request)", -0.01, 0.02),
    Scenario("large", "large regression (p shifted by N(-0.08, 0.04) per request)", -0.08, 0.04),
    Scenario("skewed", "skewed lengths, a few long requests dominate (p shifted by N(-0.02, 0.03))", -0.02, 0.03, 1.5),
)}


def _arm_counts(p: np.ndarray, lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One arm's accepted tokens, draft tokens and drafts per request: [requests, 3]."""
    mean_accepted = sum(p ** j for j in range(1, K + 1))  # E[accepted per draft]: P(position j - 1 accepted) summed
    drafts = np.maximum(1, rng.poisson(lengths / (1.0 + mean_accepted)))
    p_per_draft = np.repeat(p, drafts)
    accepted = np.minimum(rng.geometric(1.0 - p_per_draft) - 1, K)  # the chain: accepted until the first rejection
    per_request = np.bincount(np.repeat(np.arange(len(p)), drafts), weights=accepted, minlength=len(p))
    return np.stack([per_request, K * drafts, drafts], axis=1).astype(np.float64)


def population(scenario: Scenario, size: int, seed: int = 0) -> np.ndarray:
    """`size` paired requests of the scenario, in qual.stats.PAIRED_COLUMNS' order: [size, 6]."""
    rng = np.random.default_rng(seed)
    p = rng.beta(4.0, 2.0, size)
    q = np.clip(p + rng.normal(scenario.shift_mean, scenario.shift_sd, size), 0.0, 0.995) if scenario.shift_sd else p
    if scenario.length_sigma:
        lengths = np.minimum(np.ceil(np.exp(rng.normal(math.log(64), scenario.length_sigma, size))), 4096)
    else:
        lengths = np.full(size, 64.0)
    out = np.concatenate([_arm_counts(p, lengths, rng), _arm_counts(q, lengths, rng)], axis=1)
    assert out.shape[1] == len(PAIRED_COLUMNS)
    return out


def percentile_bounds(resampled: np.ndarray, confidence: float) -> tuple[float, float] | None:
    """The plain percentile interval: the (1 - confidence) / 2 and (1 + confidence) / 2 percentiles of the resamples."""
    finite = resampled[np.isfinite(resampled)]
    if finite.size == 0:
        return None
    tail = (1.0 - confidence) / 2.0 * 100.0
    lo, hi = np.percentile(finite, [tail, 100.0 - tail])
    return float(lo), float(hi)


def _t(p: float, n: int) -> float:
    return student_t_quantile(p, max(n - 1, 1))


def _rate_gradient(sums: np.ndarray) -> np.ndarray:
    """d(rate delta) / d(column sums) at each row of sums [rows, 6]: the delta method's linearisation."""
    a, t, _, b, u, _ = sums.T
    zero = np.zeros_like(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.stack([-1 / t, a / t ** 2, zero, 1 / u, -b / u ** 2, zero], axis=1)


def candidate_bounds(x: np.ndarray, n_resamples: int, seed: int,
                     confidence: float) -> dict[str, tuple[float, float] | None]:
    """The rate delta's interval by each method measured before qual's was chosen, on the same resamples as qual's:
    the plain percentile, BCa, the studentized bootstrap (bootstrap-t, delta-method standard errors), the delta method
    and the jackknife with Student's t on n - 1 degrees of freedom, the expanded percentile (n - 1 degrees of
    freedom), and qual's (the expanded percentile on the kurtosis-adjusted degrees of freedom)."""
    n, alpha = x.shape[0], 1.0 - confidence
    products = (x[:, :, None] * x[:, None, :]).reshape(n, -1)  # resampled with the sums: each resample's x x^T
    sums = resample(np.concatenate([x, products], axis=1), n_resamples, seed)
    total, resampled, left_out = sums.total[:, :6], sums.resampled[:, :6], sums.left_out[:, :6]
    value = float(delta_rate_of(total)[0])
    boot, jack = delta_rate_of(resampled), delta_rate_of(left_out)
    grad = _rate_gradient(total)[0]
    se = math.sqrt(n / max(n - 1, 1) * float(np.sum((x @ grad) ** 2)))
    jack_se = math.sqrt((n - 1) / n * float(np.sum((jack - jack.mean()) ** 2)))
    out = {"percentile": percentile_bounds(boot, confidence), "qual": bounds(boot, jack, confidence)}
    t = _t(1 - alpha / 2, n)
    out["delta t"] = (value - t * se, value + t * se)
    out["jackknife t"] = (value - t * jack_se, value + t * jack_se)
    tail = NormalDist().cdf(-math.sqrt(n / max(n - 1, 1)) * t) * 100
    out["expanded"] = tuple(np.percentile(boot, [tail, 100 - tail]))
    # BCa: bias from the share of resamples below the estimate, acceleration from the jackknife's skewness
    share = float(np.clip(np.mean(boot < value) + 0.5 * np.mean(boot == value), 1e-6, 1 - 1e-6))
    z0, d = NormalDist().inv_cdf(share), jack.mean() - jack
    denominator = 6.0 * float(np.sum(d ** 2)) ** 1.5
    accel = float(np.sum(d ** 3)) / denominator if denominator > 0 else 0.0

    def bca(q: float) -> float:
        z = NormalDist().inv_cdf(q)
        return 100 * NormalDist().cdf(z0 + (z0 + z) / (1 - accel * (z0 + z)))

    out["BCa"] = tuple(np.percentile(boot, [bca(alpha / 2), bca(1 - alpha / 2)]))
    # bootstrap-t: each resample's (estimate - value) / its own delta-method standard error
    grads = _rate_gradient(resampled)  # [resamples, 6]
    moments = sums.resampled[:, 6:].reshape(-1, 6, 6)  # [resamples, 6, 6]: sum of x x^T over the drawn units
    with np.errstate(divide="ignore", invalid="ignore"):
        se_star = np.sqrt(n / max(n - 1, 1) * np.einsum("bi,bij,bj->b", grads, moments, grads))
        studentized = (boot - value) / se_star
    studentized = studentized[np.isfinite(studentized)]  # none where every resample repeats one unit
    if studentized.size:
        q_lo, q_hi = np.percentile(studentized, [100 * alpha / 2, 100 * (1 - alpha / 2)])
        out["studentized"] = (value - q_hi * se, value - q_lo * se)
    return {k: (float(out[k][0]), float(out[k][1])) if out.get(k) is not None else None for k in CANDIDATES}


CANDIDATES = ("percentile", "BCa", "studentized", "delta t", "jackknife t", "expanded", "qual")


@dataclass
class Tally:
    """Trials of one interval: how often its lower bound lay above the truth, its upper bound below, and its width."""

    trials: int = 0
    low: int = 0  # lower bound above the true delta: the miss that lets a regression pass the gate
    high: int = 0  # upper bound below the true delta
    width: float = 0.0
    undefined: int = 0  # trials without an interval

    def add(self, interval: tuple[float, float] | None, truth: float) -> None:
        self.trials += 1
        if interval is None:
            self.undefined += 1
            return
        self.low += interval[0] > truth
        self.high += interval[1] < truth
        self.width += interval[1] - interval[0]

    @property
    def coverage(self) -> float:
        return 1.0 - (self.low + self.high + self.undefined) / self.trials

    def tail(self, which: str) -> float:
        return getattr(self, which) / self.trials

    def keeps(self, confidence: float = CONFIDENCE) -> bool:
        """Each tail misses at most (1 - confidence) / 2 plus three of its standard errors over these trials (three:
        a table of 88 tails would show two misses beyond two standard errors by chance alone)."""
        nominal = (1.0 - confidence) / 2.0
        allowed = nominal + 3.0 * math.sqrt(nominal * (1.0 - nominal) / self.trials)
        return self.tail("low") <= allowed and self.tail("high") <= allowed


@dataclass
class Cell:
    """One scenario at one size: a tally per statistic and method."""

    tallies: dict[tuple[str, str], Tally] = field(default_factory=dict)

    def tally(self, statistic: str, method: str) -> Tally:
        return self.tallies.setdefault((statistic, method), Tally())


def run_cell(pop: np.ndarray, truth: dict[str, float], n: int, trials: int, n_resamples: int, seed: int,
             methods: tuple[str, ...] = METHODS) -> Cell:
    """`trials` samples of n requests from pop, each statistic's interval by each method on the same resamples
    (METHODS: both statistics; CANDIDATES: the rate's alone)."""
    rng = np.random.default_rng(seed)
    cell = Cell()
    for trial in range(trials):
        sample = pop[rng.integers(0, len(pop), n)]
        if methods == CANDIDATES:
            for method, interval in candidate_bounds(sample, n_resamples, trial, CONFIDENCE).items():
                cell.tally("rate", method).add(interval, truth["rate"])
            continue
        sums = resample(sample, n_resamples, seed=trial)
        for name, statistic in STATISTICS.items():
            resampled = statistic(sums.resampled)
            for method in methods:
                interval = (percentile_bounds(resampled, CONFIDENCE) if method == "percentile"
                            else bounds(resampled, statistic(sums.left_out), CONFIDENCE))
                cell.tally(name, method).add(interval, truth[name])
    return cell


def truths(pop: np.ndarray) -> dict[str, float]:
    """The population's deltas: ratios of sums over all its requests."""
    total = pop.sum(axis=0, keepdims=True)
    return {name: float(statistic(total)[0]) for name, statistic in STATISTICS.items()}


def _same(cells: dict[int, Cell], a: str, b: str) -> bool:
    """Every trial's interval of statistic a missed the truth as b's did (in the same direction) by every method."""
    return all((x.low, x.high, x.undefined) == (y.low, y.high, y.undefined)
               for cell in cells.values() for m in METHODS for x, y in [(cell.tally(a, m), cell.tally(b, m))])


def _print_table(scenario: Scenario, truth: dict[str, float], cells: dict[int, Cell], population_size: int) -> None:
    print(f"\n## {scenario.name}: {scenario.description}")
    print(f"true delta over {population_size:,} requests: rate {truth['rate'] * 100:+.3f} pp, mean acceptance length "
          f"{truth['mean acceptance length']:+.4f}")
    names = list(STATISTICS)
    if _same(cells, "rate", "mean acceptance length"):
        # draft tokens = K x drafts in both arms, so the MAL delta is K times the rate delta on every resample
        print("mean acceptance length: every interval missed exactly where the rate's did (shown once: rate)")
        names = ["rate"]
    for name in names:
        unit, scale = (" pp", 100.0) if name == "rate" else ("", 1.0)
        print(f"\n{name} delta: coverage of the 95% interval, lower bound above the truth, upper bound below it, "
              f"mean width")
        print("| requests | percentile | lo > truth | hi < truth | width | qual | lo > truth | hi < truth | width |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n, cell in cells.items():
            parts = []
            for method in METHODS:
                t = cell.tally(name, method)
                width = t.width / max(t.trials - t.undefined, 1) * scale
                parts += [f"{t.coverage * 100:.1f}%", f"{t.tail('low') * 100:.1f}%", f"{t.tail('high') * 100:.1f}%",
                          f"{width:.2f}{unit}"]
            print(f"| {n} | " + " | ".join(parts) + " |")


def _print_candidates(scenario: Scenario, cells: dict[int, Cell]) -> None:
    print(f"\n## {scenario.name}: {scenario.description}")
    print("\nrate delta: coverage of the 95% interval (% of lower bounds above the truth / of upper bounds below it; "
          "mean width in pp)")
    print("| requests | " + " | ".join(CANDIDATES) + " |")
    print("|---:|" + "---:|" * len(CANDIDATES))
    for n, cell in cells.items():
        parts = [f"{t.coverage * 100:.1f}% ({t.tail('low') * 100:.1f} / {t.tail('high') * 100:.1f}; "
                 f"{t.width / max(t.trials - t.undefined, 1) * 100:.1f})"
                 for t in (cell.tally("rate", m) for m in CANDIDATES)]
        print(f"| {n} | " + " | ".join(parts) + " |")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--sizes", default="2,3,4,5,6,7,8,16,32,64,164")
    ap.add_argument("--population", type=int, default=200_000)
    ap.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--candidates", action="store_true",
                    help="every method measured before qual's was chosen, for the rate delta (CANDIDATES)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    methods = CANDIDATES if args.candidates else METHODS
    started = time.perf_counter()
    kept: dict[int, bool] = {n: True for n in sizes}
    for name in args.scenarios.split(","):
        scenario, i = SCENARIOS[name], list(SCENARIOS).index(name)  # the same draws whichever scenarios run
        pop = population(scenario, args.population, seed=args.seed + i)
        truth = truths(pop)
        cells = {n: run_cell(pop, truth, n, args.trials, args.resamples, args.seed + 1000 * i + n, methods)
                 for n in sizes}
        if args.candidates:
            _print_candidates(scenario, cells)
        else:
            _print_table(scenario, truth, cells, args.population)
        for n, cell in cells.items():
            kept[n] &= all(cell.tally(s, "qual").keeps() for s in (["rate"] if args.candidates else STATISTICS))
    smallest = next((n for i, n in enumerate(sizes) if all(kept[m] for m in sizes[i:])), None)
    print(f"\nqual's intervals keep their {CONFIDENCE:.0%} (each tail within 3 standard errors of "
          f"{(1 - CONFIDENCE) / 2:.1%} over {args.trials} trials) in every scenario from "
          f"{smallest if smallest is not None else 'no size measured'} requests up; qual.intervals.MIN_UNITS is "
          f"{MIN_UNITS}")
    print(f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
