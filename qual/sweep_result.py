"""The Result of a sweep and its result.json form (schema "qual.result.sweep/1").

A sweep (`qual run --dcp 2,4 --draft-kv replicated,sharded`) runs the control once and compares each candidate with
it: its result.json holds the control arm once and, per candidate, what a single run's result.json holds for its
candidate (the arm, the comparison, the gate verdict, the warnings), under the same keys. A single run's result.json
is "qual.result/1" as always; docs/ARCHITECTURE.md, "Sweeps".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict

from qual import __version__
from qual.errors import QualError
from qual.outcomes import FAIL, PASS
from qual.result import (MAX_RESULT_BYTES, SCHEMA, ArmResult, Comparison, CorpusInfo, GateOutcome, Result,
                         header_json, save_result)
from qual.result import dumps as result_dumps
from qual.result import _finite as finite
from qual.result import _meta
from qual.userfiles import read_json

SWEEP_SCHEMA = "qual.result.sweep/1"


@dataclass
class SweepComparison:
    """One candidate against the sweep's control: its arm, the comparison and its own gate verdict."""

    name: str
    """The candidate arm's name (candidate-dcp2-sharded): its journal <name>.requests.jsonl, its log"""
    candidate: ArmResult
    """The candidate arm"""
    comparison: Comparison
    """It minus the control, paired per request"""
    gate: GateOutcome
    """Its own gate verdict"""
    warnings: list[str] = field(default_factory=list)
    """Differences between its provenance and the control's that change what the numbers mean"""

    def to_json(self) -> dict:
        return {"name": self.name, "gate": self.gate.to_json(), "comparison": self.comparison.to_json(),
                "candidate": self.candidate.to_json(), "warnings": list(self.warnings)}

    @classmethod
    def from_json(cls, d: dict, where: str) -> "SweepComparison":
        return cls(name=str(d["name"]), candidate=ArmResult.from_json(d["candidate"], f"{where}.candidate"),
                   comparison=Comparison.from_json(d["comparison"]), gate=GateOutcome.from_json(d["gate"]),
                   warnings=list(d.get("warnings") or []))


@dataclass
class SweepResult:
    """Everything one sweep measured and decided: the control arm once, one comparison per candidate."""

    corpus: CorpusInfo
    """Which corpus every arm replayed"""
    control: ArmResult
    """The control arm (DCP 1), run once for every candidate"""
    comparisons: list[SweepComparison]
    """One per candidate, in the order they ran"""
    created_at: str
    """When the sweep finished (ISO 8601, UTC)"""
    passed: bool
    """Every candidate's gate passed (the run's exit code: 0, else 1)"""
    qual_version: str = __version__
    """The qual that wrote the file"""
    reproduce: str = ""
    """The qual run command that runs it again"""
    seed: int = 0
    """Seeds sampling and the bootstrap's resamples [id]"""
    schema: Literal[SWEEP_SCHEMA] = SWEEP_SCHEMA
    """This file's schema and version"""
    notes: list[str] = field(default_factory=list)
    """What the sweep's shape means for its comparisons (candidates at another TP than the control's)"""
    meta: dict[str, str] = field(default_factory=dict)
    """The night's labels, qual run --meta KEY=VALUE; absent without it"""

    __pydantic_config__ = ConfigDict(use_attribute_docstrings=True)  # as qual.result.Result says

    @classmethod
    def of(cls, results: list[tuple[str, Result]], notes: list[str] | None = None) -> "SweepResult":
        """From each candidate's Result against the one control (qual.harness.build.build_result)."""
        first = results[0][1]
        return cls(corpus=first.corpus, control=first.control, created_at=first.created_at,
                   comparisons=[SweepComparison(name, r.candidate, r.comparison, r.gate, list(r.warnings))
                                for name, r in results],
                   passed=all(r.gate.passed for _, r in results), qual_version=first.qual_version,
                   reproduce=first.reproduce, seed=first.seed, notes=list(notes or []), meta=dict(first.meta))

    @property
    def verdict(self) -> str:
        return PASS if self.passed else FAIL

    def names(self) -> list[str]:
        return [c.name for c in self.comparisons]

    def result(self, name: str) -> Result:
        """One candidate's comparison as a single run's Result (what the reports, the gate and the history read)."""
        c = next((c for c in self.comparisons if c.name == name), None)
        if c is None:
            raise KeyError(name)
        return Result(corpus=self.corpus, control=self.control, candidate=c.candidate, comparison=c.comparison,
                      gate=c.gate, created_at=self.created_at, qual_version=self.qual_version, reproduce=self.reproduce,
                      seed=self.seed, warnings=list(c.warnings), meta=dict(self.meta))

    def results(self) -> list[tuple[str, Result]]:
        return [(c.name, self.result(c.name)) for c in self.comparisons]

    def to_json(self) -> dict:
        return finite({
            **header_json(self),
            "passed": self.passed,
            "notes": list(self.notes),
            "control": self.control.to_json(),
            "comparisons": [c.to_json() for c in self.comparisons],
            **({"meta": dict(self.meta)} if self.meta else {}),
        })

    @classmethod
    def from_json(cls, d: dict, source: str = "<result>") -> "SweepResult":
        if not isinstance(d, dict) or d.get("schema") != SWEEP_SCHEMA:
            raise QualError(f"{source}: not a sweep's result (schema {SWEEP_SCHEMA!r})")
        try:
            comparisons = [SweepComparison.from_json(c, f"{source}: comparisons[{i}]")
                           for i, c in enumerate(d["comparisons"])]
            if not comparisons:
                raise QualError(f"{source}: comparisons: a sweep's result holds at least one")
            return cls(corpus=CorpusInfo(**d["corpus"]), control=ArmResult.from_json(d["control"], f"{source}: control"),
                       comparisons=comparisons, created_at=d["created_at"],
                       passed=all(c.gate.passed for c in comparisons), qual_version=d.get("qual_version", "unknown"),
                       reproduce=d.get("reproduce", ""), seed=d.get("seed", 0), notes=list(d.get("notes") or []),
                       meta=_meta(d.get("meta"), source))
        except (KeyError, TypeError) as exc:
            raise QualError(f"{source}: malformed sweep result ({type(exc).__name__}: {exc})") from None


def dumps(sweep: SweepResult) -> str:
    """result.json text of a sweep (written as a single run's is)."""
    return result_dumps(sweep)


def save_sweep(sweep: SweepResult, path: str | Path) -> Path:
    """Write a sweep's result.json (atomically, as qual.result.save_result does a single run's)."""
    return save_result(sweep, path)


def load_any(path: str | Path) -> Result | SweepResult:
    """A result.json of either shape: a single run's Result, or a SweepResult (any other schema: QualError)."""
    path = Path(path)
    try:
        data = read_json(path, MAX_RESULT_BYTES, "result file")
    except OSError as exc:
        raise QualError(f"cannot read {path}: {exc.strerror or exc}") from None
    if isinstance(data, dict) and data.get("schema") == SWEEP_SCHEMA:
        return SweepResult.from_json(data, str(path))
    if isinstance(data, dict) and data.get("schema") != SCHEMA:
        raise QualError(f"{path}: unsupported result schema {data.get('schema')!r} (this qual reads {SCHEMA!r} and "
                        f"{SWEEP_SCHEMA!r})")
    return Result.from_json(data, str(path))

