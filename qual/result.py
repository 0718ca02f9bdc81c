"""The Result of one control-vs-candidate run and its result.json form (schema "qual.result/1").

The keys tests/test_result.py lists (CONTRACT) are a contract: extend, never rename. Rates are
fractions; an undefined rate is null.
"""

from __future__ import annotations

import functools
import json
import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass

from pathlib import Path
from typing import Any, Callable, TypedDict, TypeVar

from qual import __version__
from qual.baseline import BaselineComparison
from qual.errors import QualError
from qual.files import write_text
from qual.latency import LatencySummary
from qual.records import EngineBuild, HostFacts, RecordError, RequestResult
from qual.stats import DEFAULT_NEAR_TIE_MARGIN, Acceptance, PositionInterval, ci_key
from qual.userfiles import read_json

SCHEMA = "qual.result/1"
MAX_RESULT_BYTES = 1 << 30  # a result.json read back (compare, --baseline): every request's tokens, but bounded
ARMS = ("control", "candidate")
T = TypeVar("T")


@dataclass
class CorpusInfo:
    """Which corpus both arms replayed."""

    name: str
    path: str
    fingerprint: str
    count: int

    @classmethod
    def from_corpus(cls, corpus: Any) -> "CorpusInfo":
        """From a qual.corpus Corpus (name, path, fingerprint, requests)."""
        return cls(str(corpus.name), str(corpus.path), str(corpus.fingerprint), len(corpus.requests))


@dataclass
class Throughput:
    wall_seconds: float  # the arm, start-up included
    output_tokens: int
    tokens_per_second: float  # output_tokens / wall_seconds
    generate_seconds: float | None = None  # generation alone, where the engine reports it (the reference engine does)

    @property
    def generate_tokens_per_second(self) -> float | None:
        return self.output_tokens / self.generate_seconds if self.generate_seconds else None


class CheckpointRecord(TypedDict):
    """One checkpoint as a run used it (qual.checkpoints.identity.checkpoint_record)."""

    path: str
    revision: str | None  # the hub revision the profile pins (target_revision / draft_revision)
    identity: str  # "sha256:<hex>" of a local directory's files, "hub:<id>@<revision>", or "not observed (...)"


class ChatTemplateRecord(TypedDict):
    """The chat template a run rendered its chat rows with (qual.chat.ChatTemplate.record)."""

    source: str  # the file: the tokenizer's chat_template.jinja or tokenizer_config.json, or --chat-template's
    name: str | None  # the named template chosen ("default"), None where there was one
    sha256: str  # of the template's text


class Checkpoints(TypedDict):
    target: CheckpointRecord
    draft: CheckpointRecord | None  # None: no drafter


@dataclass
class Provenance:
    """Which qual, machine, engine build and inputs produced one arm (the harness collects it; qual.provenance)."""

    qual_version: str
    qual_commit: str | None  # HEAD of the checkout qual ran from; None for an installed wheel
    qual_checkout_dirty: bool | None  # tracked files differed from that commit
    host: HostFacts  # where qual ran (an attached server's own host is engine.host)
    engine: EngineBuild
    corpus_fingerprint: str
    gate_sha256: str | None  # the gate file's bytes
    checkpoints: Checkpoints | None = None  # None in results written before qual recorded them
    chat_template: ChatTemplateRecord | None = None  # what chat rows were rendered with; None: no chat rows

    @classmethod
    def from_json(cls, d: dict) -> "Provenance":
        return cls(**{**d, "host": HostFacts(**d["host"]), "engine": EngineBuild.from_json(d["engine"])})


def _field(where: str, key: str, build: Callable[[], T]) -> T:
    """An arm's field built from its JSON object: a key missing or unknown inside it is the file's fault, named by
    the field's path."""
    try:
        return build()
    except KeyError as exc:
        raise QualError(f"{where}.{key}: missing key {exc}") from None
    except TypeError as exc:  # an unknown key (the record's __init__), or a value inside of another type
        raise QualError(f"{where}.{key}: {exc}") from None


_JSON_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "true or false", type(None): "null"}


def _json_types(hint: Any) -> tuple[type, ...]:
    """What json.loads gives for a field of this annotation: records (dataclasses, TypedDicts) and dicts are objects."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _json_types(arg))
    if hint in (str, bool, type(None)):
        return (hint,)
    if hint is list or typing.get_origin(hint) is list:
        return (list,)
    if hint is dict or typing.get_origin(hint) is dict or is_dataclass(hint) or typing.is_typeddict(hint):
        return (dict,)
    raise TypeError(f"no JSON type for {hint!r}")  # a new kind of field: say what a result.json holds there


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, as an error message shows it."""
    return "a number" if type(value) in (int, float) else _JSON_NAMES.get(type(value), type(value).__name__)


@dataclass
class ArmResult:
    """One arm: its config, acceptance, per-request results, graph capture and throughput."""

    config: dict
    acceptance: Acceptance
    per_request: list[RequestResult]
    graph_capture: dict
    throughput: Throughput
    engine_version: str
    runnable: bool = True
    not_runnable_reason: str | None = None
    log_path: str | None = None
    provenance: Provenance | None = None  # None in results written before qual recorded it
    extra: dict = field(default_factory=dict)  # the engine's facts about the arm (records.ArmRunInfo.extra)
    latency: LatencySummary | None = None  # None where no request was timed (results written before qual timed them)

    def to_json(self) -> dict:
        return {
            "config": self.config,
            "acceptance": self.acceptance.to_json(),
            "per_request": [r.to_json() for r in self.per_request],
            "graph_capture": self.graph_capture,
            "throughput": asdict(self.throughput),
            "engine_version": self.engine_version,
            "runnable": self.runnable,
            "not_runnable_reason": self.not_runnable_reason,
            "log_path": self.log_path,
            "provenance": asdict(self.provenance) if self.provenance is not None else None,
            "extra": self.extra,
            "latency": self.latency,
        }

    @classmethod
    def from_json(cls, d: dict, where: str = "arm") -> "ArmResult":
        for key, python_types in _arm_field_types().items():  # read later as these (.get, .items, paths, text)
            if key in d and type(d[key]) not in python_types:
                expected = " or ".join(_JSON_NAMES[t] for t in python_types)
                raise QualError(f"{where}.{key}: expected {expected}, got {_json_type(d[key])}")
        cfg = d["config"]
        k = cfg.get("num_speculative_tokens") if cfg.get("draft_path") else None
        records = []
        for i, r in enumerate(d["per_request"]):
            try:  # each record's internal consistency: a hand-edited result is refused, naming the record
                records.append(RequestResult.from_json(r, k if isinstance(k, int) else None))
            except RecordError as exc:
                raise QualError(f"{where}.per_request[{i}]: {exc}") from None
        return cls(
            config=cfg,
            acceptance=_field(where, "acceptance", lambda: Acceptance.from_json(d["acceptance"])),
            per_request=records,
            graph_capture=d["graph_capture"],
            throughput=_field(where, "throughput", lambda: Throughput(**d["throughput"])),
            engine_version=d["engine_version"],
            runnable=d.get("runnable", True),
            not_runnable_reason=d.get("not_runnable_reason"),
            log_path=d.get("log_path"),
            provenance=_field(where, "provenance", lambda: Provenance.from_json(d["provenance"]))
            if d.get("provenance") else None,
            extra=d.get("extra") or {},
            latency=d.get("latency"),
        )


@functools.cache
def _arm_field_types() -> dict[str, tuple[type, ...]]:
    """Each ArmResult field's JSON types, from its annotation (the one qual.schema writes the JSON Schema from): another
    type in a result.json is the file's fault, refused by name, never a bug's exit 4 or a field silently dropped."""
    hints = typing.get_type_hints(ArmResult)
    return {f.name: _json_types(hints[f.name]) for f in fields(ArmResult)}


class SpeculativeAndPlain(TypedDict):
    """One number of the speculative arm (the candidate) and of plain decoding."""

    speculative: float | None
    plain: float | None


@dataclass
class Speedup:
    """`qual run --speedup`: the candidate against plain decoding, paired per request (docs/statistics.md "Speedup").

    Plain decoding is the candidate's own configuration without the drafter."""

    plain: ArmResult  # the third arm: the candidate's configuration, no drafter
    decode_tokens_per_second: SpeculativeAndPlain  # per request: sum of (tokens - 1) / sum of first-to-last seconds
    ratio: float | None  # speculative / plain decode tokens/s
    ratio_ci95: list[float] | None  # paired bootstrap over requests (qual.intervals)
    n_requests: int  # paired requests both arms timed (the ratio's and the interval's)
    mean_acceptance_length: float | None  # the candidate's: tokens a speculative step commits on average
    step_s: SpeculativeAndPlain  # seconds of one decode step (arms.<arm>.latency.step_s)
    bound: float | None  # mean_acceptance_length x plain step_s / speculative step_s
    generate_tokens_per_second: SpeculativeAndPlain  # all requests together: output tokens / generation seconds
    target_outputs_identical: bool | None  # plain decoding's outputs equal the candidate's (greedy: they must)
    bootstrap: Bootstrap = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**asdict(self), "plain": self.plain.to_json()}

    @classmethod
    def from_json(cls, d: dict, where: str = "speedup") -> "Speedup":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "plain"}
        return cls(plain=ArmResult.from_json(d["plain"], f"{where}.plain"), **known)


class OutputDivergence(TypedDict):
    """A request whose target outputs differ between the arms (qual.stats.compare_outputs)."""

    id: str
    category: str
    first_divergence: int
    control_token: int | None
    candidate_token: int | None
    top2_margin: float | None
    classification: str  # benign_near_tie | disagreement


class ProposalDivergence(TypedDict, total=False):
    """Draft steps taken at identical context whose proposals differ (qual.stats.proposal_divergence)."""

    overall: float | None
    per_position: list[float | None]
    matched_steps: int
    differing_steps: int
    control_steps: int
    candidate_steps: int


class _RatesOfBothArms(TypedDict):
    """A group of requests' acceptance rates in both arms and the draft tokens behind them."""

    n: int
    control_rate: float | None
    candidate_rate: float | None
    delta: float | None
    control_draft_tokens: int
    candidate_draft_tokens: int


class CategoryDelta(_RatesOfBothArms):
    """One category's rates in both arms (qual.stats.per_category)."""

    category: str


class _TurnOfRequest(TypedDict, total=False):
    """A request that is a turn of a conversation of several (absent: a request of one turn)."""

    turn: int
    earlier_turns_differ: bool  # its prompts differ between the arms: their earlier answers did


class RequestDelta(_TurnOfRequest):
    """One request's rates in both arms (qual.stats.per_request_deltas)."""

    id: str
    category: str
    control_rate: float | None
    candidate_rate: float | None
    delta: float | None


class TurnDelta(_RatesOfBothArms):
    """One turn of the conversations: its requests' rates in both arms (qual.stats.per_turn)."""

    turn: int
    earlier_turns_differ: int  # requests of this turn whose prompts differ between the arms


class Bootstrap(TypedDict, total=False):
    """How the intervals were computed."""

    unit: str
    method: str
    resamples: int
    seed: int
    n_requests: int


@dataclass
class Comparison:
    """Candidate minus control, paired per request."""

    delta_rate: float | None = None
    delta_rate_ci95: list[float] | None = None
    delta_rate_ci: dict[str, list[float] | None] = field(default_factory=dict)  # "0.9" -> [lo, hi]
    delta_mean_acceptance_length: float | None = None
    delta_mean_acceptance_length_ci95: list[float] | None = None
    target_outputs_identical: bool | None = None
    output_divergence: list[OutputDivergence] = field(default_factory=list)
    near_tie_margin: float = DEFAULT_NEAR_TIE_MARGIN
    proposal_divergence: ProposalDivergence = field(default_factory=dict)
    per_category: list[CategoryDelta] = field(default_factory=list)
    per_request_deltas: list[RequestDelta] = field(default_factory=list)
    bootstrap: Bootstrap = field(default_factory=dict)
    # Each draft position's rates with 95% intervals, from the resamples of delta_rate_ci (absent in older results).
    per_position: list[PositionInterval] = field(default_factory=list)
    # Conversations of several turns: acceptance per turn, and the later turns whose earlier turns differ between the
    # arms (their prompts hold each arm's own answers; their outputs are not compared). Empty for one-turn requests.
    per_turn: list[TurnDelta] = field(default_factory=list)
    earlier_turns_differ: list[str] = field(default_factory=list)

    def ci_at(self, confidence: float) -> tuple[float, float] | None:
        ci = self.delta_rate_ci.get(ci_key(confidence))
        if ci is None and abs(confidence - 0.95) < 1e-12:
            ci = self.delta_rate_ci95
        return (ci[0], ci[1]) if ci is not None else None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Comparison":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


@dataclass
class CheckResult:
    """Outcome of one check, with a human detail string carrying the numbers.

    A skipped check could not be evaluated (what it compares was not observed): it is not passed, and the gate
    passes on the checks that were evaluated (GateOutcome.passed).
    """

    name: str
    passed: bool
    detail: str
    skipped: bool = False

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "detail": self.detail, "skipped": self.skipped}


# Why a gate failed where no check did: said wherever the verdict is (stdout, summary.md, report.html, junit.xml)
DECIDED_NOTHING = "every check was skipped: a gate that decides nothing fails"


@dataclass
class GateOutcome:
    """All checks of a gate; passed only if every check passed."""

    passed: bool
    checks: list[CheckResult] = field(default_factory=list)
    source: str | None = None

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed and not c.skipped]

    @property
    def decided_nothing(self) -> bool:
        """Every check was skipped (or there was none): no check failed, yet the gate fails (qual.gate.evaluate)."""
        return not self.passed and all(c.skipped for c in self.checks)

    def to_json(self) -> dict:
        return {"passed": self.passed, "source": self.source, "checks": [c.to_json() for c in self.checks]}

    @classmethod
    def from_json(cls, data: dict) -> "GateOutcome":
        checks = [CheckResult(c["name"], bool(c["passed"]), c["detail"], bool(c.get("skipped", False)))
                  for c in data.get("checks", [])]
        return cls(passed=bool(data["passed"]), checks=checks, source=data.get("source"))


def header_json(run) -> dict:
    """The keys a run's result.json and a sweep's open with: its schema, when and by which qual it was written, how to
    run it again, its seed and its corpus."""
    return {"schema": run.schema, "created_at": run.created_at, "qual_version": run.qual_version,
            "reproduce": run.reproduce, "seed": run.seed, "corpus": asdict(run.corpus)}


@dataclass
class Result:
    """Everything one `qual run` measured and decided; every report renders this."""

    corpus: CorpusInfo
    control: ArmResult
    candidate: ArmResult
    comparison: Comparison
    gate: GateOutcome
    created_at: str
    qual_version: str = __version__
    reproduce: str = ""
    seed: int = 0
    schema: str = SCHEMA
    baseline: BaselineComparison | None = None  # tonight's arms against an earlier run (`qual run --baseline`)
    # Differences between the arms' provenance that change what the numbers mean (engine version, dtype, GPU type).
    warnings: list[str] = field(default_factory=list)
    speedup: Speedup | None = None  # the candidate against plain decoding (`qual run --speedup`)

    @property
    def arms(self) -> dict[str, ArmResult]:
        return {"control": self.control, "candidate": self.candidate}

    @property
    def verdict(self) -> str:
        return "pass" if self.gate.passed else "fail"

    def to_json(self) -> dict:
        data = {
            **header_json(self),
            "gate": self.gate.to_json(),
            "comparison": self.comparison.to_json(),
            "arms": {name: arm.to_json() for name, arm in self.arms.items()},
            "warnings": list(self.warnings),
        }
        if self.baseline is not None:  # only with --baseline: a run without one writes what it always wrote
            data["baseline"] = self.baseline.to_json()
        if self.speedup is not None:  # only with --speedup
            data["speedup"] = self.speedup.to_json()
        return _finite(data)

    @classmethod
    def from_json(cls, d: dict, source: str = "<result>") -> "Result":
        schema = d.get("schema") if isinstance(d, dict) else None
        if schema != SCHEMA:
            raise QualError(f"{source}: unsupported result schema {schema!r} (this qual reads {SCHEMA!r})")
        try:
            return cls(
                corpus=CorpusInfo(**d["corpus"]),
                control=ArmResult.from_json(d["arms"]["control"], f"{source}: arms.control"),
                candidate=ArmResult.from_json(d["arms"]["candidate"], f"{source}: arms.candidate"),
                comparison=Comparison.from_json(d["comparison"]),
                gate=GateOutcome.from_json(d["gate"]),
                created_at=d["created_at"],
                qual_version=d.get("qual_version", "unknown"),
                reproduce=d.get("reproduce", ""),
                seed=d.get("seed", 0),
                baseline=BaselineComparison.from_json(d["baseline"]) if d.get("baseline") else None,
                warnings=list(d.get("warnings") or []),
                speedup=Speedup.from_json(d["speedup"], f"{source}: speedup") if d.get("speedup") else None,
            )
        except (KeyError, TypeError) as exc:
            raise QualError(f"{source}: malformed result ({type(exc).__name__}: {exc})") from None


def _finite(obj: Any) -> Any:
    """NaN/inf become null so result.json stays strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(result: Result) -> str:
    """result.json text."""
    return json.dumps(result.to_json(), indent=1, allow_nan=False) + "\n"


def save_result(result: Result, path: str | Path) -> Path:
    """Write result.json (atomically: a half-written file never carries the final name)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, dumps(result))


def load_result(path: str | Path) -> Result:
    """Read result.json; an unknown schema or malformed file is a QualError."""
    path = Path(path)
    try:
        data = read_json(path, MAX_RESULT_BYTES, "result file")
    except OSError as exc:
        raise QualError(f"cannot read {path}: {exc.strerror or exc}") from None
    return Result.from_json(data, str(path))
