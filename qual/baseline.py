"""Baselines: which earlier runs are the same configuration as tonight's, and tonight's arms against one of them.

A baseline is an earlier run whose arms tonight's arms are compared with, request by request (docs/statistics.md,
"Baselines"). This module holds the records only (result.json's `baseline` key); the configuration a run belongs to
is qual.configuration, finding and checking a baseline qual.harness.baseline, computing the comparison
qual.harness.build.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from qual.stats import ci_key

ARMS = ("control", "candidate")


@dataclass
class BaselineArm:
    """One arm of tonight against the same arm of the baseline, paired by request id (tonight minus baseline)."""

    compared: bool  # both tonight's arm and the baseline's ran
    reason: str | None = None  # why not compared
    n_requests: int = 0  # requests compared: tonight's that the baseline ran too
    not_in_baseline: int = 0  # tonight's requests the baseline did not run (it replayed another selection)
    retokenized: list[str] = field(default_factory=list)  # ids whose prompt token ids differ from the baseline's
    baseline_rate: float | None = None
    tonight_rate: float | None = None
    baseline_mean_acceptance_length: float | None = None
    tonight_mean_acceptance_length: float | None = None
    delta_rate: float | None = None
    delta_rate_ci: dict[str, list[float] | None] = field(default_factory=dict)  # "0.95" -> [lo, hi]
    delta_mean_acceptance_length: float | None = None
    delta_mean_acceptance_length_ci95: list[float] | None = None
    per_position: list[dict] = field(default_factory=list)  # position, baseline, tonight, delta, ci (95%)
    per_category: list[dict] = field(default_factory=list)  # category, n, baseline_rate, tonight_rate, delta
    moved: list[dict] = field(default_factory=list)  # requests whose rate moved most: id, category, baseline_rate, ...

    def ci_at(self, confidence: float) -> tuple[float, float] | None:
        ci = self.delta_rate_ci.get(ci_key(confidence))
        return (ci[0], ci[1]) if ci is not None else None

    @classmethod
    def from_json(cls, d: dict) -> "BaselineArm":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class BaselineComparison:
    """Tonight's run against its baseline: where the baseline came from, what differs, each arm, the trend."""

    ref: str  # as given to --baseline: a result path, a history id, history:last-pass
    chosen_by: str  # "result file" | "history id" | "pinned" | "last pass" | "previous series" | "nearest pass"
    history_id: int | None
    result_path: str
    created_at: str  # the baseline run's
    configuration: str  # ConfigurationKey.describe() of the baseline run
    differs: list[dict] = field(default_factory=list)  # arm, key, baseline, tonight: allowed differences, shown
    arms: dict[str, BaselineArm] = field(default_factory=dict)
    trend: list[dict] = field(default_factory=list)  # earlier runs of tonight's configuration, oldest first
    bootstrap: dict = field(default_factory=dict)
    forced: bool = False  # --baseline-any: taken although its configuration key differs from tonight's
    key_differences: list[dict] = field(default_factory=list)  # key, tonight, baseline: each field of the key that differs
    # What changed between the baseline's night and tonight beside the key: the engine's version, torch, qual, the
    # machine (qual.nights.changes), one phrase each: "engine vllm 0.32.0 -> 0.33.0"
    changed: list[str] = field(default_factory=list)

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
        return cls(**known)
