"""Strict parsing of user-written config sections (pydantic) into one-line errors that name the file and key."""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from qual.errors import QualError
from qual.userfiles import MAX_CONFIG_BYTES, not_utf8, read_text

M = TypeVar("M", bound=BaseModel)

# No coercion ("4" is not 4), no unknown keys, no NaN or infinity, immutable once parsed; each field's docstring is its
# description in the section's JSON Schema (`qual schema --profile`).
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True, use_attribute_docstrings=True)
_SHOWN = 80  # characters of a bad value echoed back (a YAML alias bomb must not be printed whole)


class Section(BaseModel):
    """Base of every config section: strict as above."""

    model_config = STRICT


_REPR = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 3, 4, 4, 4
_REPR.maxstring = _REPR.maxother = _SHOWN


def ascii_digits(text: str) -> bool:
    """Whether text is one or more ASCII digits: what int() and a kernel take as a number (str.isdigit also says yes
    to '²' and '٢', which int() refuses or reads as another number)."""
    return text.isascii() and text.isdigit()


def shown(value) -> str:
    """A bounded repr of a user's value for an error message (never expands a YAML alias bomb)."""
    text = _REPR.repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def describe_error(exc: ValidationError, prefix: str = "") -> str:
    """The first problem of a pydantic error as 'key: what is wrong (got value)'."""
    err = exc.errors(include_url=False)[0]
    key = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(err["loc"]))
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"{key}: unknown key"
    if err["type"] == "missing":
        return f"{key}: missing"
    if err["type"] == "value_error" and "error" in err.get("ctx", {}):  # a validator's own words, as it wrote them
        msg = str(err["ctx"]["error"])
    else:
        msg = err["msg"][0].lower() + err["msg"][1:]
    return f"{key}: {msg} (got {shown(err.get('input'))})"


def parse_flags(options_class, /, **values):
    """Command-line values validated as `options_class` (a pydantic dataclass); a QualError naming the flag."""
    for name, value in values.items():
        # a swept flag's values, --meta's keys and values: every text the run records
        items = value if isinstance(value, tuple) else (*value, *value.values()) if isinstance(value, dict) else (value,)
        for item in items:
            problem = not_utf8(item, "--" + name.replace("_", "-")) if isinstance(item, str) else None
            if problem is not None:
                raise problem
    try:
        return options_class(**values)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-")
        raise QualError(f"{flag}: {describe_error(exc).partition(': ')[2]}") from None


def read_config_text(path: Path) -> str:
    """A config file's text: a regular file of at most MAX_CONFIG_BYTES, UTF-8 (else a QualError); OSError of the
    open passes through (qual/userfiles.py)."""
    return read_text(path, MAX_CONFIG_BYTES, "config file")


def parse_section(model: type[M], data, where: str, prefix: str = "") -> M:
    """data validated as `model`; a QualError '<where>: <key>: <problem>' otherwise."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise QualError(f"{where}: {prefix or 'the file'} must be a mapping (got {shown(data)})")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise QualError(f"{where}: {describe_error(exc, prefix)}") from None


def schema_document(title: str, schema: dict, schema_id: str | None = None) -> dict:
    """A generated JSON Schema as a document of its own: the draft it follows (2020-12), its name, its title."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **({"$id": schema_id} if schema_id else {}),
            "title": title, **schema}


def tidy_schema(node, drop: tuple[str, ...] = ()):
    """A generated JSON Schema as qual prints it: `drop` keys removed from every schema object in it (a property named
    like one of them stays), and each description on one line (a docstring wraps)."""
    if isinstance(node, list):
        return [tidy_schema(n, drop) for n in node]
    if not isinstance(node, dict):
        return node
    return {k: (" ".join(v.split()) if k == "description" else tidy_schema(v, drop) if k != "properties" else
                {p: tidy_schema(s, drop) for p, s in v.items()}) for k, v in node.items() if k not in drop}
