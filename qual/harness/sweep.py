"""Sweeps: `qual run --dcp 2,4 --draft-kv replicated,sharded` runs the control once and each candidate of the product
of the listed values against it (docs/ARCHITECTURE.md, "Sweeps").

A comma list in a swept option is what makes a run a sweep; a single value is a run as it always was. Candidates are
named by their values (`candidate-dcp2-sharded`: the DCP size, then each other swept option's value), which also
names their journals and logs. Each candidate takes the TP the single run of it would take (--tp, else the profile's,
else its DCP size); the control is the first candidate at DCP 1 and the largest of those TP sizes, so that the
sweep's candidate of the largest TP is compared exactly as its single run would be.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Annotated, Any

from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.functional_validators import PlainValidator
from pydantic_core import PydanticCustomError

from qual.errors import QualError
from qual.options import SWEEP_SEPARATOR
from qual.validation import ascii_digits
from qual.records import ArmConfig

# The run options a sweep may list several values of (RunOptions fields) and their flags, in the order candidates are
# named and enumerated.
SWEPT = {"dcp": "--dcp", "draft_kv": "--draft-kv", "dsa_topk": "--dsa-topk"}
CONTROL = "control"
CANDIDATE = "candidate"  # a single run's candidate arm; a sweep's candidates are named candidate-<values>


def one_or_many(scalar: Any) -> Any:
    """A RunOptions field type: one value of `scalar` (as always), or a list of two or more distinct ones (a sweep).

    Each value is checked as `scalar` alone would be, with pydantic's own message ("input should be a valid
    integer"); a list of one, or a value listed twice, is refused."""
    adapter = TypeAdapter(scalar, config=ConfigDict(strict=True, allow_inf_nan=False))

    def one(value):
        try:
            return adapter.validate_python(value)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            raise PydanticCustomError(err["type"], err["msg"].replace("{", "(").replace("}", ")")) from None

    def check(value):
        if not isinstance(value, (list, tuple)):
            return one(value)
        values = tuple(one(v) for v in value)
        if len(values) < 2:
            raise PydanticCustomError("sweep", "a list of values needs two or more (one value is given as itself)")
        if len(set(values)) < len(values):
            raise PydanticCustomError("sweep", "a value is listed twice")
        return values

    return Annotated[Any, PlainValidator(check)]


def split_flags(values: dict) -> dict:
    """Command-line values of the swept flags: "2,4" -> (2, 4), "4" -> 4 (DCP sizes as integers where they are
    numbers; anything else is left for RunOptions to refuse, naming the flag)."""
    out = dict(values)
    for name in SWEPT:
        text = out.get(name)
        if not isinstance(text, str):
            continue
        parts = [p.strip() for p in text.split(SWEEP_SEPARATOR)]
        if name == "dcp":
            parts = [int(p) if ascii_digits(p.removeprefix("+").removeprefix("-")) else p for p in parts]
        out[name] = parts[0] if len(parts) == 1 else tuple(parts)
    return out


def values(options, name: str) -> tuple:
    """The values of one swept option: a sweep's list, or the single value (None: not given) as a 1-tuple."""
    value = getattr(options, name)
    return value if isinstance(value, tuple) else (value,)


def swept(options) -> list[str]:
    """The options given as lists (empty: not a sweep)."""
    return [name for name in SWEPT if isinstance(getattr(options, name), tuple)]


def describe(options) -> str:
    """'--dcp 2,4 --draft-kv replicated,sharded': the lists that make the run a sweep."""
    return " ".join(f"{SWEPT[n]} {SWEEP_SEPARATOR.join(map(str, values(options, n)))}" for n in swept(options))


def check_supported(options, engine: str, attaches: bool) -> None:
    """What a sweep cannot do, refused by name before anything starts (exit 2)."""
    if not swept(options):
        return
    if attaches:
        raise QualError(f"{describe(options)}: a sweep runs one candidate per value; --engine {engine} attaches "
                        "to one running candidate server (--candidate-url): give one value per option")
    if options.baseline is not None:
        raise QualError(f"--baseline with a sweep ({describe(options)}): a baseline compares one run's two arms with an "
                        "earlier run's; run each candidate alone with --baseline")


def candidate_name(arm: ArmConfig, names: list[str]) -> str:
    """candidate-dcp<N>, then the value of each other swept option: the arm's name, journal and log."""
    parts = [f"dcp{arm.dcp}", *(str(getattr(arm, n)) for n in names if n != "dcp")]
    return "-".join([CANDIDATE, *parts])


def arms(options, base: ArmConfig, dcps: list[int], default_draft_kv: str, tp_of) -> dict[str, ArmConfig]:
    """control first, then the candidates: one "candidate" for a single run, candidate-<values> for each point of a
    sweep's product (in the order the values were listed). dcps: the DCP sizes (defaults resolved); tp_of(dcp) is a
    candidate's TP."""
    names = swept(options)
    points = product(dcps, values(options, "draft_kv"), values(options, "dsa_topk"))
    candidates = [replace(base, dcp=dcp, tp=tp_of(dcp), draft_kv=kv or default_draft_kv, dsa_topk=topk)
                  for dcp, kv, topk in points]
    if not names:
        (only,) = candidates
        return {CONTROL: replace(only, dcp=1), CANDIDATE: only}
    control = replace(candidates[0], dcp=1, tp=max(c.tp for c in candidates))
    return {CONTROL: control, **{candidate_name(c, names): c for c in candidates}}


def tp_note(arms: dict[str, ArmConfig]) -> str | None:
    """Where a sweep's candidates differ in TP, what that means for the comparisons (None where they do not)."""
    control = arms[CONTROL]
    others = sorted({a.tp for name, a in arms.items() if name != CONTROL and a.tp != control.tp})
    if not others:
        return None
    return (f"the control runs once, at TP {control.tp} (the sweep's largest); candidates at TP "
            f"{', '.join(map(str, others))} (their DCP size, as a single run of them would) differ from it in TP too: "
            "give --tp to hold TP fixed across the sweep")
