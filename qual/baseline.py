"""Baselines: which earlier runs are the same configuration as tonight's, and tonight's arms against one of them.

A baseline is an earlier run whose arms tonight's arms are compared with, request by request (docs/statistics.md,
"Baselines"). This module holds the records only (result.json's `baseline` key); the configuration a run belongs to
is qual.configuration, finding and checking a baseline qual.harness.baseline, computing the comparison
qual.harness.build.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from qual.nights import axis_choices, is_axis
from qual.stats import ci_key

ARMS = ("control", "candidate")
# How a baseline was chosen (result.json baseline.chosen_by)
RESULT_FILE, HISTORY_ID, PINNED, LAST, PREVIOUS_SERIES, NEAREST = (
    "result file", "history id", "pinned", "last pass", "previous series", "nearest pass")


@dataclass
class BaselineArm:
    """One arm of tonight against the same arm of the baseline, paired by request id (tonight minus baseline)."""

    compared: bool
    """Both tonight's arm and the baseline's ran"""
    reason: str | None = None
    """Why not compared"""
    n_requests: int = 0
    """The requests paired by id: tonight's that the baseline ran too [count]"""
    not_in_baseline: int = 0
    """Tonight's requests the baseline did not run: it replayed another selection of the corpus [count]"""
    retokenized: list[str] = field(default_factory=list)
    """Ids whose prompt token ids differ from the baseline's"""
    baseline_rate: float | None = None
    """The baseline arm's acceptance rate over the paired requests [fraction]"""
    tonight_rate: float | None = None
    """Tonight's [fraction]"""
    baseline_mean_acceptance_length: float | None = None
    """The baseline arm's mean acceptance length [tokens]"""
    tonight_mean_acceptance_length: float | None = None
    """Tonight's [tokens]"""
    delta_rate: float | None = None
    """tonight_rate - baseline_rate [fraction]"""
    delta_rate_ci: dict[str, list[float] | None] = field(default_factory=dict)
    """Its paired-bootstrap interval at each confidence level, "0.95" -> [lo, hi] [fraction]"""
    delta_mean_acceptance_length: float | None = None
    """Tonight's minus the baseline's mean acceptance length [tokens]"""
    delta_mean_acceptance_length_ci95: list[float] | None = None
    """Its 95% paired-bootstrap interval [tokens]"""
    per_position: list[dict] = field(default_factory=list)
    """Each draft position: position, baseline, tonight, delta, ci (95%)"""
    per_category: list[dict] = field(default_factory=list)
    """Each category: category, n, baseline_rate, tonight_rate, delta"""
    moved: list[dict] = field(default_factory=list)
    """The requests whose rate moved most: id, category, baseline_rate, tonight_rate, delta"""

    def ci_at(self, confidence: float) -> tuple[float, float] | None:
        ci = self.delta_rate_ci.get(ci_key(confidence))
        return (ci[0], ci[1]) if ci is not None else None

    @classmethod
    def from_json(cls, d: dict) -> "BaselineArm":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class BaselineComparison:
    """Tonight's run against its baseline: where the baseline came from, what differs, each arm, the trend."""

    ref: str
    """As given to --baseline: a result path, a history id, history:last-pass"""
    chosen_by: str
    """result file, history id, pinned, last pass, previous series (the last pass of the series tonight's follows:
    another drafter or target, another selection) or nearest pass (--baseline-any)"""
    history_id: int | None
    """The baseline's history id; null for a result file [id]"""
    result_path: str
    """The baseline's result.json"""
    created_at: str
    """When the baseline run finished"""
    configuration: str
    """The baseline run's configuration key, every field"""
    differs: list[dict] = field(default_factory=list)
    """Differences allowed and shown: arm, key, baseline, tonight"""
    arms: dict[str, BaselineArm] = field(default_factory=dict)
    """Each arm of tonight against the same arm of the baseline"""
    trend: list[dict] = field(default_factory=list)
    """Earlier runs of tonight's configuration, oldest first: run_id, created_at, verdict, each arm's rate, baseline,
    and what an axis reads: engine, qual (version and commit), meta (--meta labels)"""
    bootstrap: dict = field(default_factory=dict)
    """How the intervals were computed"""
    forced: bool = False
    """--baseline-any: taken although its configuration key differs from tonight's"""
    key_differences: list[dict] = field(default_factory=list)
    """Each field of the configuration key that differs: key, tonight, baseline"""
    changed: list[str] = field(default_factory=list)
    """What changed between the baseline's night and tonight beside the key, one phrase each: the engine's version,
    torch, CUDA, the driver, the GPU, the host, qual ("engine vllm 0.32.0 -> 0.33.0")"""
    axis: str = "date"
    """What the report's strip of the trend runs along (qual run --axis): date, engine, qual or meta:KEY; date in a
    result written before it"""

    @property
    def label(self) -> str:
        """'run 12 (pinned)' or the result path: how reports and history name the baseline."""
        if self.history_id is None:
            return self.result_path
        return f"run {self.history_id} ({self.chosen_by})"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "BaselineComparison":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        known["arms"] = {name: BaselineArm.from_json(a) for name, a in (d.get("arms") or {}).items()}
        axis = known.get("axis", "date")
        if not isinstance(axis, str) or not is_axis(axis):
            raise TypeError(f"baseline.axis: expected {axis_choices()}, got {axis!r:.60}")
        return cls(**known)
