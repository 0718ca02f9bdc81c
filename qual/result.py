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
from typing import Annotated, Any, Callable, Literal, TypeVar

from pydantic import ConfigDict, Field

from typing_extensions import NotRequired, TypedDict, is_typeddict  # as qual.records says

from qual import __version__
from qual.baseline import BaselineComparison
from qual.errors import QualError
from qual.files import write_text
from qual.latency import LatencySummary
from qual.outcomes import FAIL, INCONCLUSIVE, PASS, SKIPPED
from qual.records import ArmConfig, EngineBuild, GraphCapture, HostFacts, RecordError, RequestResult, written_as
from qual.stats import DEFAULT_NEAR_TIE_MARGIN, Acceptance, AcceptanceJson, PositionInterval, ci_key
from qual.userfiles import read_json

SCHEMA = "qual.result/1"
MAX_RESULT_BYTES = 1 << 30  # a result.json read back (compare, --baseline): every request's tokens, but bounded
ARMS = ("control", "candidate")
T = TypeVar("T")


@dataclass
class CorpusInfo:
    """Which corpus both arms replayed."""

    name: str
    """The corpus's name"""
    path: str
    """The corpus file"""
    fingerprint: str
    """The corpus's content hash (sha256:...): runs are compared only on equal fingerprints"""
    count: int
    """The rows replayed: the corpus's first N with --limit, else all [count]"""

    @classmethod
    def from_corpus(cls, corpus: Any) -> "CorpusInfo":
        """From a qual.corpus Corpus (name, path, fingerprint, requests)."""
        return cls(str(corpus.name), str(corpus.path), str(corpus.fingerprint), len(corpus.requests))


@dataclass
class Throughput:
    """What one arm generated and the time it took."""

    wall_seconds: float
    """The arm from start to end, the engine's start-up included [seconds]"""
    output_tokens: int
    """The tokens it generated, over all requests [tokens]"""
    tokens_per_second: float
    """output_tokens / wall_seconds [tokens/s]"""
    generate_seconds: float | None = None
    """Generation alone, without the engine's start-up, where the engine reports it (the reference engine does; vLLM:
    null) [seconds]"""

    @property
    def generate_tokens_per_second(self) -> float | None:
        return self.output_tokens / self.generate_seconds if self.generate_seconds else None


class CheckpointRecord(TypedDict):
    """One checkpoint as a run used it (qual.checkpoints.identity.checkpoint_record)."""

    path: str
    """The checkpoint as the arm named it: a local directory or a hub id"""
    revision: str | None
    """The hub revision the profile pins (target_revision, draft_revision); else null"""
    identity: str
    """What it holds: sha256:<hex> of a local directory's files, hub:<id>@<revision>, or not observed (...)"""


class ChatTemplateRecord(TypedDict):
    """The chat template a run rendered its chat rows with (qual.chat.ChatTemplate.record)."""

    source: str
    """The template's file: the tokenizer's chat_template.jinja or tokenizer_config.json, or --chat-template's"""
    name: str | None
    """The named template chosen (default); null where the file holds one"""
    sha256: str
    """sha256 of the template's text"""


class Checkpoints(TypedDict):
    """The checkpoints an arm used."""

    target: CheckpointRecord
    """The target's"""
    draft: CheckpointRecord | None
    """The drafter's; null without one"""


@dataclass
class Provenance:
    """Which qual, machine, engine build and inputs produced one arm (the harness collects it; qual.provenance)."""

    qual_version: str
    """The qual that ran the arm"""
    qual_commit: str | None
    """HEAD of the checkout qual ran from; null for an installed wheel"""
    qual_checkout_dirty: bool | None
    """Whether tracked files differed from that commit; null where there is no checkout"""
    host: HostFacts
    """Where qual ran (an attached server's own host is engine.host)"""
    engine: EngineBuild
    """The engine build that ran the arm"""
    corpus_fingerprint: str
    """The corpus's content hash"""
    gate_sha256: str | None
    """sha256 of the gate file's bytes"""
    checkpoints: Checkpoints | None = None
    """The checkpoints the arm used; null in results written before qual recorded them"""
    chat_template: ChatTemplateRecord | None = None
    """The template chat rows were rendered with; null without chat rows"""

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
    if hint is dict or typing.get_origin(hint) is dict or is_dataclass(hint) or is_typeddict(hint):
        return (dict,)
    raise TypeError(f"no JSON type for {hint!r}")  # a new kind of field: say what a result.json holds there


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, as an error message shows it."""
    return "a number" if type(value) in (int, float) else _JSON_NAMES.get(type(value), type(value).__name__)


@dataclass
class ArmResult:
    """One arm: its config, acceptance, per-request results, graph capture and throughput."""

    config: Annotated[dict, written_as(ArmConfig)]
    """Everything that defines the arm"""
    acceptance: Annotated[Acceptance, written_as(AcceptanceJson)]
    """Its acceptance, summed over its requests"""
    per_request: list[RequestResult]
    """Each request's outcome, in corpus order"""
    graph_capture: Annotated[dict, written_as(GraphCapture)]
    """Its CUDA-graph capture"""
    throughput: Throughput
    """What it generated and the time it took"""
    engine_version: str
    """The engine and its version (a field of the configuration key: another version is another series)"""
    runnable: bool = True
    """False where the arm could not run here (vLLM at DCP > 1 on a CPU): it has no requests then"""
    not_runnable_reason: str | None = None
    """Why it could not run"""
    log_path: str | None = None
    """The engine's log (a vLLM server's), where there is one"""
    provenance: Provenance | None = None
    """Which qual, machine, engine build and inputs produced the arm; null in results written before qual recorded it"""
    extra: dict = field(default_factory=dict)
    """The engine's facts about the arm (where acceptance came from, draft-KV replication in the build, the server
    command, async decode)"""
    latency: LatencySummary | None = None
    """Its requests' latencies, summarized; null where no request was timed"""

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
    """Tokens a second of the speculative arm (the candidate) and of plain decoding."""

    speculative: float | None
    """The candidate's, decoding with its drafter [tokens/s]"""
    plain: float | None
    """Plain decoding's: the candidate's configuration without its drafter [tokens/s]"""


class StepSeconds(TypedDict):
    """One decode step of the speculative arm (the candidate) and of plain decoding."""

    speculative: float | None
    """The candidate's: a draft and its verify [seconds]"""
    plain: float | None
    """Plain decoding's: one target step [seconds]"""


@dataclass
class Speedup:
    """`qual run --speedup`: the candidate against plain decoding, paired per request (docs/statistics.md "Speedup").

    Plain decoding is the candidate's own configuration without the drafter."""

    plain: ArmResult
    """The third arm: the candidate's configuration without its drafter"""
    decode_tokens_per_second: SpeculativeAndPlain
    """Per arm, over the paired requests: sum of (tokens - 1) / sum of seconds from first to last token"""
    ratio: float | None
    """Speculative over plain decode_tokens_per_second: what speculation buys a request [ratio]"""
    ratio_ci95: list[float] | None
    """The ratio's 95% interval, a paired bootstrap over requests (qual.intervals) [ratio]"""
    n_requests: int
    """The requests both arms timed: the ratio's and the interval's [count]"""
    mean_acceptance_length: float | None
    """The candidate's: tokens a speculative step commits on average [tokens]"""
    step_s: StepSeconds
    """One decode step in each arm (arms.<arm>.latency.step_s)"""
    bound: float | None
    """What the acceptance allows: mean_acceptance_length x plain step_s / speculative step_s; it bounds ratio, the
    per-request decode rate ratio [ratio]"""
    generate_tokens_per_second: SpeculativeAndPlain
    """Per arm, all requests together: output tokens / generation seconds (the batch throughput)"""
    target_outputs_identical: bool | None
    """Plain decoding's outputs equal the candidate's (greedy: they must)"""
    bootstrap: Bootstrap = field(default_factory=dict)
    """How the interval was computed"""
    batch_ratio: float | None = None
    """Speculative over plain generate_tokens_per_second: the batch throughput's ratio, one number per arm and no
    interval (the bound does not apply to it); null in results written before qual reported it [ratio]"""
    directions_agree: bool | None = None
    """ratio and batch_ratio say the same (both at least 1, or both below): speculation speeds each request and the
    batch alike; false: they disagree in direction (the report says why that can be)"""

    def to_json(self) -> dict:
        return {**asdict(self), "plain": self.plain.to_json()}

    @classmethod
    def from_json(cls, d: dict, where: str = "speedup") -> "Speedup":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "plain"}
        return cls(plain=ArmResult.from_json(d["plain"], f"{where}.plain"), **known)


class OutputDivergence(TypedDict):
    """A request whose target outputs differ between the arms (qual.stats.compare_outputs)."""

    id: str
    """The request"""
    category: str
    """Its category"""
    first_divergence: int
    """The first output position where the arms' tokens differ [index]"""
    control_token: int | None
    """The control's token there; null where its output ended first [id]"""
    candidate_token: int | None
    """The candidate's token there; null where its output ended first [id]"""
    top2_margin: float | None
    """The target's top-1 minus top-2 logit there, where an arm recorded margins [logits]"""
    classification: str
    """benign_near_tie (a margin below near_tie_margin: reduced precision can flip such a token) or disagreement (a
    confident one: a bug)"""


class ProposalDivergence(TypedDict, total=False):
    """Draft steps taken at identical context whose proposals differ (qual.stats.proposal_divergence)."""

    overall: float | None
    """Of the draft steps both arms took at identical context, the share whose proposals differ [fraction]"""
    per_position: list[float | None]
    """Per draft position, the share of those steps whose proposal there differs [fraction]"""
    matched_steps: int
    """Draft steps both arms took at identical context [count]"""
    differing_steps: int
    """Of those, the steps whose proposals differ [count]"""
    control_steps: int
    """Draft steps the control recorded [count]"""
    candidate_steps: int
    """Draft steps the candidate recorded [count]"""


# The records below repeat their shared fields rather than inherit them: pydantic reads a TypedDict's field
# docstrings from its own class body only, and every field's docstring is its description in the JSON Schema.
class CategoryDelta(TypedDict):
    """One category's rates in both arms (qual.stats.per_category)."""

    n: int
    """Requests in the group [count]"""
    control_rate: float | None
    """The group's acceptance rate in the control [fraction]"""
    candidate_rate: float | None
    """The group's acceptance rate in the candidate [fraction]"""
    delta: float | None
    """candidate_rate - control_rate [fraction]"""
    control_draft_tokens: int
    """The draft tokens behind the control's rate [tokens]"""
    candidate_draft_tokens: int
    """The draft tokens behind the candidate's rate [tokens]"""
    category: str
    """The category"""


class RequestDelta(TypedDict):
    """One request's rates in both arms (qual.stats.per_request_deltas)."""

    turn: NotRequired[int]
    """Its turn in a conversation of several (absent: a request of one turn) [index]"""
    earlier_turns_differ: NotRequired[bool]
    """Its prompts differ between the arms: their earlier answers did (absent: a request of one turn)"""
    id: str
    """The request"""
    category: str
    """Its category"""
    control_rate: float | None
    """Its acceptance rate in the control [fraction]"""
    candidate_rate: float | None
    """Its acceptance rate in the candidate [fraction]"""
    delta: float | None
    """candidate_rate - control_rate [fraction]"""


class TurnDelta(TypedDict):
    """One turn of the conversations: its requests' rates in both arms (qual.stats.per_turn)."""

    n: int
    """Requests in the group [count]"""
    control_rate: float | None
    """The group's acceptance rate in the control [fraction]"""
    candidate_rate: float | None
    """The group's acceptance rate in the candidate [fraction]"""
    delta: float | None
    """candidate_rate - control_rate [fraction]"""
    control_draft_tokens: int
    """The draft tokens behind the control's rate [tokens]"""
    candidate_draft_tokens: int
    """The draft tokens behind the candidate's rate [tokens]"""
    turn: int
    """The turn [index]"""
    earlier_turns_differ: int
    """Requests of this turn whose prompts differ between the arms [count]"""


class Bootstrap(TypedDict, total=False):
    """How the intervals were computed."""

    unit: str
    """What is resampled: request, or conversation where requests are turns of conversations"""
    method: str
    """How the intervals are read off the resamples: the paired expanded percentile, kurtosis-adjusted
    (qual.intervals)"""
    resamples: int
    """Resamples drawn [count]"""
    seed: int
    """The resamples' seed [id]"""
    n_requests: int
    """Resampling units (requests, or conversations) [count]"""


@dataclass
class Comparison:
    """Candidate minus control, paired per request."""

    delta_rate: float | None = None
    """Candidate minus control acceptance rate, each a ratio of sums over the paired requests [fraction]"""
    delta_rate_ci95: Annotated[list[float] | None, Field(deprecated=True)] = None
    """Deprecated: the same interval as delta_rate_ci["0.95"], kept for readers of earlier files [fraction]"""
    delta_rate_ci: dict[str, list[float] | None] = field(default_factory=dict)
    """delta_rate's paired-bootstrap interval at each confidence level the gate asks for (0.95 always), keyed "0.95" ->
    [lo, hi]; null where undefined [fraction]"""
    delta_mean_acceptance_length: float | None = None
    """Candidate minus control mean acceptance length [tokens]"""
    delta_mean_acceptance_length_ci95: list[float] | None = None
    """Its 95% paired-bootstrap interval [tokens]"""
    target_outputs_identical: bool | None = None
    """Every request's target output is the same in both arms; null where not compared"""
    output_divergence: list[OutputDivergence] = field(default_factory=list)
    """Each request whose outputs differ: where, and whether it is a near tie"""
    near_tie_margin: float = DEFAULT_NEAR_TIE_MARGIN
    """A divergence whose top-2 logit margin is below this is a benign near tie [logits]"""
    proposal_divergence: ProposalDivergence = field(default_factory=dict)
    """Draft steps both arms took at identical context whose proposals differ"""
    per_category: list[CategoryDelta] = field(default_factory=list)
    """Each category's rates in both arms"""
    per_request_deltas: list[RequestDelta] = field(default_factory=list)
    """Each request's rates in both arms"""
    bootstrap: Bootstrap = field(default_factory=dict)
    """How the intervals were computed"""
    per_position: list[PositionInterval] = field(default_factory=list)
    """Each draft position's rates with 95% intervals, from the resamples of delta_rate_ci (absent in older results)"""
    per_turn: list[TurnDelta] = field(default_factory=list)
    """Conversations of several turns: acceptance per turn; empty for requests of one turn"""
    earlier_turns_differ: list[str] = field(default_factory=list)
    """Later turns whose earlier turns differ between the arms: their prompts hold each arm's own answers, so their
    outputs are not compared"""

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


class CheckNumbers(TypedDict):
    """What a check compared, as numbers: value op threshold, in unit."""

    value: float | None
    """The number compared; null where there was none (an arm that did not run) [unit]"""
    threshold: float | None
    """The rule's bound [unit]"""
    op: str
    """How value must stand to threshold to pass: >=, == or <="""
    unit: str
    """pp (percentage points of acceptance), ratio, rate (a fraction), mean acceptance length, requests, sizes or ran
    (1 where the arm ran)"""


@dataclass
class CheckResult:
    """Outcome of one check, with a human detail string carrying the numbers and the numbers themselves.

    A skipped check could not be evaluated (what it compares was not observed): it is not passed, and the gate
    passes on the checks that were evaluated (GateOutcome.passed). An inconclusive check was decided on an
    interval that straddles its threshold: it is not passed, and it does not fail the gate by itself
    (GateOutcome.outcome); needed_requests is how many requests would resolve it at the variance observed.
    """

    name: str
    """The check (the gate rule's check)"""
    passed: bool
    """It was evaluated and passed"""
    detail: str
    """What it found, with the numbers, in words"""
    skipped: bool = False
    """It could not be evaluated (what it compares was not observed): neither passed nor failed"""
    inconclusive: bool = False
    """Decided on an interval that straddles its threshold: neither passed nor failed (the gate's outcome is
    INCONCLUSIVE unless another check failed)"""
    needed_requests: int | None = None
    """An inconclusive check's: the requests that would resolve it at the variance observed; null where none would
    (zero variance, or the point on the threshold) [count]"""
    value: float | None = None
    """The number compared (a check over both arms: per_arm) [unit]"""
    threshold: float | None = None
    """The rule's bound [unit]"""
    op: str | None = None
    """How value must stand to threshold to pass: >=, == or <="""
    unit: str | None = None
    """What value and threshold count: pp, ratio, rate, mean acceptance length, requests, sizes or ran"""
    per_arm: dict[str, CheckNumbers] = field(default_factory=dict)
    """A check over both arms: each arm's numbers"""

    @property
    def outcome(self) -> str:
        """pass | fail | inconclusive | skipped."""
        if self.skipped:
            return SKIPPED
        if self.inconclusive:
            return INCONCLUSIVE
        return PASS if self.passed else FAIL

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "detail": self.detail, "skipped": self.skipped,
                "inconclusive": self.inconclusive, "needed_requests": self.needed_requests, "value": self.value,
                "threshold": self.threshold, "op": self.op, "unit": self.unit, "per_arm": self.per_arm}

    @classmethod
    def from_json(cls, c: dict) -> "CheckResult":
        return cls(c["name"], bool(c["passed"]), c["detail"], bool(c.get("skipped", False)),
                   bool(c.get("inconclusive", False)), c.get("needed_requests"), c.get("value"), c.get("threshold"),
                   c.get("op"), c.get("unit"), dict(c.get("per_arm") or {}))


# What a series' first night under `--baseline history:last-pass` says where a comparison with the baseline would be
FIRST_NIGHT = "first night of this series: no earlier pass to compare with; it becomes the baseline if it passes"
# Why a gate failed where no check did: said wherever the verdict is (stdout, summary.md, report.html, junit.xml)
DECIDED_NOTHING = "every check was skipped: a gate that decides nothing fails"


def gate_outcome(checks: list[CheckResult]) -> str:
    """FAIL > INCONCLUSIVE > PASS over the evaluated checks; a gate that evaluated none decided nothing: FAIL."""
    outcomes = {c.outcome for c in checks} - {SKIPPED}
    if not outcomes or FAIL in outcomes:
        return FAIL
    return INCONCLUSIVE if INCONCLUSIVE in outcomes else PASS


@dataclass
class GateOutcome:
    """All checks of a gate and its outcome; passed (exit 0) on PASS, and on INCONCLUSIVE where the gate says so."""

    passed: bool
    """The run exits 0 on it: every evaluated check passed and at least one was evaluated, or the outcome is
    INCONCLUSIVE and the gate file says inconclusive: pass"""
    checks: list[CheckResult] = field(default_factory=list)
    """Each check, in the gate file's order"""
    source: str | None = None
    """The gate file"""
    outcome: str = FAIL
    """pass, fail (any check failed, or none was evaluated) or inconclusive (none failed, some interval straddled its
    threshold); absent in results written before: passed says pass or fail"""
    inconclusive: str = "fail"
    """What an INCONCLUSIVE outcome exits with, as the gate file says: fail (1) or pass (0)"""

    @classmethod
    def of(cls, checks: list[CheckResult], source: str | None, inconclusive: str = "fail") -> "GateOutcome":
        outcome = gate_outcome(checks)
        passed = outcome == PASS or (outcome == INCONCLUSIVE and inconclusive == "pass")
        return cls(passed=passed, checks=checks, source=source, outcome=outcome, inconclusive=inconclusive)

    @property
    def failed(self) -> list[CheckResult]:
        """The checks that failed decisively."""
        return [c for c in self.checks if c.outcome == FAIL]

    @property
    def not_passed(self) -> list[CheckResult]:
        """The checks that failed or were inconclusive."""
        return [c for c in self.checks if c.outcome in (FAIL, INCONCLUSIVE)]

    @property
    def decided_nothing(self) -> bool:
        """Every check was skipped (or there was none): no check failed, yet the gate fails (qual.gate.evaluate)."""
        return not self.passed and all(c.skipped for c in self.checks)

    @property
    def word(self) -> str:
        """PASS, FAIL or INCONCLUSIVE: what the verdict line, summary.md and report.html say."""
        return self.outcome.upper()

    def to_json(self) -> dict:
        return {"passed": self.passed, "outcome": self.outcome, "inconclusive": self.inconclusive,
                "source": self.source, "checks": [c.to_json() for c in self.checks]}

    @classmethod
    def from_json(cls, data: dict) -> "GateOutcome":
        checks = [CheckResult.from_json(c) for c in data.get("checks", [])]
        passed = bool(data["passed"])
        return cls(passed=passed, checks=checks, source=data.get("source"),
                   outcome=data.get("outcome") or (PASS if passed else FAIL),
                   inconclusive=data.get("inconclusive") or "fail")


def header_json(run) -> dict:
    """The keys a run's result.json and a sweep's open with: its schema, when and by which qual it was written, how to
    run it again, its seed and its corpus."""
    return {"schema": run.schema, "created_at": run.created_at, "qual_version": run.qual_version,
            "reproduce": run.reproduce, "seed": run.seed, "corpus": asdict(run.corpus)}


@dataclass
class Result:
    """Everything one `qual run` measured and decided; every report renders this."""

    corpus: CorpusInfo
    """Which corpus both arms replayed"""
    control: ArmResult
    """The control arm: DCP 1"""
    candidate: ArmResult
    """The candidate arm: DCP N"""
    comparison: Comparison
    """Candidate minus control, paired per request"""
    gate: GateOutcome
    """The gate's verdict and its checks"""
    created_at: str
    """When the run finished (ISO 8601, UTC)"""
    qual_version: str = __version__
    """The qual that wrote the file"""
    reproduce: str = ""
    """The qual run command that runs it again"""
    seed: int = 0
    """Seeds sampling and the bootstrap's resamples [id]"""
    schema: Literal[SCHEMA] = SCHEMA
    """This file's schema and version"""
    baseline: BaselineComparison | None = None
    """Tonight's arms against an earlier run's (qual run --baseline); absent without it"""
    warnings: list[str] = field(default_factory=list)
    """Differences between the arms' provenance that change what the numbers mean (engine version, dtype, GPU type)"""
    speedup: Speedup | None = None
    """The candidate against plain decoding (qual run --speedup); absent without it"""
    meta: dict[str, str] = field(default_factory=dict)
    """The night's labels, qual run --meta KEY=VALUE (a deployment commit, a CI run's URL); absent without it"""
    first_night: bool = False
    """The first night of its series under --baseline history:last-pass: nothing to compare with yet, so the gate's
    baseline rules were skipped; it becomes the series' baseline if it passes. Absent where false"""

    # result.json's JSON Schema (qual/schema.py) takes each field's docstring, here and in every record below, as its
    # description
    __pydantic_config__ = ConfigDict(use_attribute_docstrings=True)

    @property
    def arms(self) -> dict[str, ArmResult]:
        return {"control": self.control, "candidate": self.candidate}

    @property
    def verdict(self) -> str:
        """pass | fail | inconclusive (the gate's outcome)."""
        return self.gate.outcome

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
        if self.meta:  # only with --meta
            data["meta"] = dict(self.meta)
        if self.first_night:
            data["first_night"] = True
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
                meta=_meta(d.get("meta"), source),
                first_night=d.get("first_night") is True,
            )
        except (KeyError, TypeError) as exc:
            raise QualError(f"{source}: malformed result ({type(exc).__name__}: {exc})") from None


def _meta(value: Any, source: str) -> dict[str, str]:
    """result.json's `meta`: the night's --meta labels, texts by name."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise QualError(f"{source}: meta: expected an object of texts, got {_json_type(value)}")
    return dict(value)


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
