"""The gate file's model: its rules and their parameters as pydantic models, the one spelling of what a gate file may
say. qual validates every gate file with it (one-line errors naming the file, the rule and the key) and `qual schema
--gate` prints its JSON Schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from qual.errors import QualError
from qual.stats import DEFAULT_NEAR_TIE_MARGIN
from qual.validation import schema_document, shown

ARMS = ("control", "candidate")
GATE_SCHEMA = "qual.gate/1"
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)
Arm = Literal["control", "candidate"]


def _what(text: str, **kw: Any) -> Any:
    """A parameter: its description says what it must be (the error message's words)."""
    return Field(description=text, **kw)


class _Rule(BaseModel):
    model_config = _STRICT

    def params(self) -> dict:
        """The rule's parameters, defaults filled in (what the check function takes)."""
        return {k: v for k, v in self.model_dump().items() if k != "check"}


class _ArmsRule(_Rule):
    arms: list[Arm] = _what("a non-empty list of distinct arms (control, candidate)", default=list(ARMS), min_length=1)

    @field_validator("arms")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("arms listed twice")
        return v


_CONFIDENCE = _what("a number in (0, 1)", default=0.95, gt=0, lt=1)
_WITHOUT_BASELINE = _what("'fail' or 'skip'", default="fail")
_MAX_PP = _what("a number of percentage points >= 0", ge=0)


class AcceptanceDeltaLowerBound(_Rule):
    """Candidate minus control acceptance rate: the interval's lower bound must clear min_pp."""

    check: Literal["acceptance_delta_lower_bound"]
    min_pp: float = _what("a number of percentage points")
    confidence: float = _CONFIDENCE


class MeanAcceptanceLengthRatio(_Rule):
    """Candidate / control mean acceptance length must be at least min."""

    check: Literal["mean_acceptance_length_ratio"]
    min: float = _what("a positive number", gt=0)


class TargetOutputsIdentical(_Rule):
    """Both arms' target outputs are identical (near ties allowed where the rule says so)."""

    check: Literal["target_outputs_identical"]
    when_temperature: float | None = _what("a temperature >= 0 or null", default=0, ge=0)
    allow: Literal["none", "benign_near_tie"] = _what("'none' or 'benign_near_tie'", default="none")
    near_tie_margin: float = _what("a logit margin >= 0", default=DEFAULT_NEAR_TIE_MARGIN, ge=0)


class GraphSizesCaptured(_Rule):
    """Every CUDA-graph size the control captured, the candidate captured too."""

    check: Literal["graph_sizes_captured"]


class CandidateRunnable(_Rule):
    """The candidate arm ran."""

    check: Literal["candidate_runnable"]


class BaselineDeltaLowerBound(_ArmsRule):
    """Each arm against the baseline's same arm: the interval's lower bound of tonight minus baseline must clear
    min_pp."""

    check: Literal["baseline_delta_lower_bound"]
    min_pp: float = _what("a number of percentage points")
    confidence: float = _CONFIDENCE
    without_baseline: Literal["fail", "skip"] = _WITHOUT_BASELINE


class PerPositionDelta(_ArmsRule):
    """No draft position may lose more than max_pp against the baseline."""

    check: Literal["per_position_delta"]
    max_pp: float = _MAX_PP
    positions: list[Annotated[int, Field(ge=0)]] | None = _what(
        "null or a non-empty list of distinct draft positions (integers >= 0)", default=None, min_length=1)
    without_baseline: Literal["fail", "skip"] = _WITHOUT_BASELINE

    @field_validator("positions")
    @classmethod
    def _distinct(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError("positions listed twice")
        return v


class CategoryDelta(_ArmsRule):
    """No category of requests may lose more than max_pp against the baseline."""

    check: Literal["category_delta"]
    max_pp: float = _MAX_PP
    without_baseline: Literal["fail", "skip"] = _WITHOUT_BASELINE


class AcceptanceFloor(_ArmsRule):
    """Absolute floors of each arm's acceptance rate and mean acceptance length (for the models named)."""

    check: Literal["acceptance_floor"]
    min_rate: float | None = _what("null or a rate in [0, 1]", default=None, ge=0, le=1)
    min_mean_acceptance_length: float | None = _what("null or a mean acceptance length >= 1", default=None, ge=1)
    models: list[Annotated[str, Field(min_length=1)]] | None = _what(
        "null or a non-empty list of model profile names", default=None, min_length=1)

    @model_validator(mode="after")
    def _some_floor(self) -> "AcceptanceFloor":
        if self.min_rate is None and self.min_mean_acceptance_length is None:
            raise ValueError("give min_rate, min_mean_acceptance_length or both (a floor of neither checks nothing)")
        return self


RULES: dict[str, type[_Rule]] = {m.model_fields["check"].annotation.__args__[0]: m for m in (
    CandidateRunnable, AcceptanceDeltaLowerBound, MeanAcceptanceLengthRatio, TargetOutputsIdentical, GraphSizesCaptured,
    BaselineDeltaLowerBound, PerPositionDelta, CategoryDelta, AcceptanceFloor)}
Rule = Annotated[Union[tuple(RULES.values())], Field(discriminator="check")]


class _GateHead(BaseModel):
    """A gate file's keys beside its rules (parse_rules validates these alone: each rule is validated once, by
    _rule, where its own errors are worded)."""

    model_config = _STRICT
    name: str | None = _what("the gate's name", default=None)
    description: str | None = _what("what the gate is for", default=None)
    inconclusive: Literal["fail", "pass"] = _what(
        "'fail' (exit 1, the default) or 'pass' (exit 0): what a gate whose outcome is INCONCLUSIVE exits with",
        default="fail")


class GateFile(_GateHead):
    """A gate file: the rules a run must pass, in order."""

    rules: list[Rule] = _what("the rules, evaluated in order", min_length=1)


@dataclass(frozen=True)
class GateRule:
    """One rule of a gate file: a check name and its validated parameters."""

    check: str
    params: dict
    index: int = 0
    source: str = "<inline>"

    def to_json(self) -> dict:
        return {"check": self.check, **self.params}


@dataclass(frozen=True)
class Gate:
    """An ordered list of rules, what INCONCLUSIVE exits with, and the file they came from."""

    rules: tuple[GateRule, ...]
    source: str = "<inline>"
    inconclusive: str = "fail"
    # "sha256:<hex>" of the bytes the rules were read from (None: inline rules): what provenance and run.json record,
    # so that both name the rules the verdict used, whatever the file holds by the time the run ends
    sha256: str | None = None

    def params_of(self, check: str) -> list[dict]:
        return [r.params for r in self.rules if r.check == check]


_TOP = tuple(_GateHead.model_fields)


def parse_rules(data: Any, source: str = "<inline>") -> Gate:
    """Validate a gate document (a list of rules, or a mapping with `rules:`) into a Gate: QualError naming the file,
    the rule and the key."""
    top: dict = {}
    if isinstance(data, dict):
        unknown = set(data) - {"rules", *_TOP}
        if unknown:
            raise QualError(f"{source}: unknown top-level keys {shown(sorted(map(str, unknown)))} "
                            f"(expected rules, {', '.join(_TOP)})")
        top = {k: data[k] for k in _TOP if k in data}
        data = data.get("rules")
    if not isinstance(data, list) or not data:
        raise QualError(f"{source}: expected a non-empty list of rules")
    rules = tuple(GateRule(rule.check, rule.params(), i, source) for i, rule in
                  ((i, _rule(raw, f"{source}: rule {i}")) for i, raw in enumerate(data)))
    try:
        head = _GateHead.model_validate(top)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        key = str(err["loc"][0])
        raise QualError(f"{source}: {key} must be {_GateHead.model_fields[key].description}, "
                        f"got {shown(err.get('input'))}") from None
    return Gate(rules, source, head.inconclusive)


def _rule(raw: Any, where: str) -> _Rule:
    if not isinstance(raw, dict) or "check" not in raw:
        raise QualError(f"{where}: expected a mapping with a 'check' key, got {shown(raw)}")
    name = raw["check"]
    model = RULES.get(name) if isinstance(name, str) else None
    if model is None:
        raise QualError(f"{where}: unknown check {shown(name)} (known: {', '.join(sorted(RULES))})")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise QualError(f"{where} ({name}): {_problem(model, raw, exc)}") from None


def _problem(model: type[_Rule], raw: dict, exc: ValidationError) -> str:
    """A rule's first problem in the words of its parameter's description."""
    errors = exc.errors(include_url=False)
    params = [k for k in model.model_fields if k != "check"]
    extra = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if extra:
        return f"unknown parameter(s) {shown(extra)} (allowed: {', '.join(params) or 'none'})"
    err = errors[0]
    if not err["loc"]:  # a rule across parameters (model_validator)
        return str(err.get("ctx", {}).get("error") or err["msg"])
    key = str(err["loc"][0])
    what = model.model_fields[key].description
    if err["type"] == "missing":
        return f"missing parameter {key!r} ({what})"
    return f"{key} must be {what}, got {shown(raw.get(key))}"


def gate_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a gate file: a mapping with `rules:`, or the list of rules alone."""
    schema = TypeAdapter(Union[GateFile, list[Rule]]).json_schema(ref_template="#/$defs/{model}")
    return schema_document(f"qual gate file ({GATE_SCHEMA})", schema, GATE_SCHEMA)
