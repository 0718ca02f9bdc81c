"""The JSON Schema of result.json, generated from its typed records (dataclasses and TypedDicts of qual.result,
qual.records, qual.stats); and of a sweep's result.json (qual.sweep_result), built from the same records.

`python -m qual.schema --write` regenerates qual/data/result.schema.json and qual/data/result.sweep.schema.json, the
one copies: they ship in the wheel, `qual schema [--sweep]` prints them and docs/ links to them. It refuses to drop or
retype a key of a committed schema while its schema string (qual.result.SCHEMA, qual.sweep_result.SWEEP_SCHEMA) is
unchanged: extend, never rename.

Numbers may be null: result.json writes an undefined rate (NaN) as null (qual.result._finite). Keys added after a
schema version's first release have defaults and are optional, so every file of that version validates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from typing import Any, Union

from qual.files import write_text
from qual.paths import RESULT_SCHEMA, SWEEP_RESULT_SCHEMA
from qual.records import ArmConfig, GraphCapture
from qual.result import SCHEMA, ArmResult, Result
from qual.stats import AcceptanceJson
from qual.sweep_result import SWEEP_SCHEMA, SweepResult
from qual.userfiles import read_json

COMMITTED = RESULT_SCHEMA
MAX_SCHEMA_BYTES = 1 << 22
SWEEP_COMMITTED = SWEEP_RESULT_SCHEMA
# Fields whose JSON form another type describes (ArmResult keeps its config as a dict; an arm's acceptance is written
# as its counts and the rates derived from them).
JSON_FORM: dict[tuple[type, str], Any] = {(ArmResult, "config"): ArmConfig, (ArmResult, "graph_capture"): GraphCapture,
                                          (ArmResult, "acceptance"): AcceptanceJson}
ARMS = ("control", "candidate")  # Result's two ArmResult fields, written under "arms"


def _merge_types(options: list[dict]) -> dict:
    """{"type": [..]} where every option is a bare type, else anyOf (keeps the schema readable)."""
    if all(set(o) == {"type"} for o in options):
        names: list[str] = []
        for o in options:
            for t in o["type"] if isinstance(o["type"], list) else [o["type"]]:
                if t not in names:
                    names.append(t)
        return {"type": names[0] if len(names) == 1 else names}
    return {"anyOf": options}


def _schema(tp: Any, defs: dict) -> dict:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return {}
    if tp is type(None):
        return {"type": "null"}
    if origin in (Union, types.UnionType):
        return _merge_types([_schema(a, defs) for a in args])
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": ["number", "null"]}  # NaN and infinities are written as null
    if tp is str:
        return {"type": "string"}
    if tp in (list, tuple) or origin in (list, tuple):
        items = [a for a in args if a is not Ellipsis]
        return {"type": "array", **({"items": _schema(items[0], defs)} if len(items) == 1 else {})}
    if tp is dict or origin is dict:
        return {"type": "object", **({"additionalProperties": _schema(args[1], defs)} if args else {})}
    if dataclasses.is_dataclass(tp) or typing.is_typeddict(tp):
        return _record(tp, defs)
    raise TypeError(f"no JSON Schema for {tp!r}")


def _keys(cls: type) -> list[tuple[str, bool]]:
    """(key, required) of a dataclass (required: no default) or a TypedDict, in declaration order."""
    if typing.is_typeddict(cls):
        return [(k, k in cls.__required_keys__) for k in typing.get_type_hints(cls)]
    return [(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)]


def _record(cls: type, defs: dict) -> dict:
    """A $ref to the record's definition (written once into defs)."""
    name = cls.__name__
    if name not in defs:
        defs[name] = {}  # placeholder: records may nest
        hints = typing.get_type_hints(cls)
        props, required = {}, []
        for key, needed in _keys(cls):
            if cls is Result and key in ARMS:
                continue
            props[key] = _schema(JSON_FORM.get((cls, key), hints[key]), defs)
            if needed:
                required.append(key)
        if cls is Result:
            arm = _record(ArmResult, defs)
            props["arms"] = {"type": "object", "properties": {a: arm for a in ARMS}, "required": list(ARMS)}
            props["schema"] = {"const": SCHEMA}
            required.append("arms")
        if cls is SweepResult:
            props["schema"] = {"const": SWEEP_SCHEMA}
            required.append("schema")
        doc = (cls.__doc__ or "").strip().splitlines()
        defs[name] = {"type": "object", **({"description": doc[0]} if doc else {}), "properties": props,
                      "required": required}
    return {"$ref": f"#/$defs/{name}"}


def result_schema() -> dict:
    """The JSON Schema (draft 2020-12) of result.json as this qual writes it."""
    defs: dict = {}
    _record(Result, defs)
    top = defs.pop(Result.__name__)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA,
            "title": f"qual result.json ({SCHEMA})", **top, "$defs": dict(sorted(defs.items()))}


def sweep_schema() -> dict:
    """The JSON Schema of a sweep's result.json: the control arm once, per candidate what result.json holds for it."""
    defs: dict = {}
    _record(SweepResult, defs)
    top = defs.pop(SweepResult.__name__)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SWEEP_SCHEMA,
            "title": f"qual result.json of a sweep ({SWEEP_SCHEMA})", **top, "$defs": dict(sorted(defs.items()))}


def key_paths(schema: dict) -> dict[str, str]:
    """Every key the schema names, as a dotted path ("arms.control.config.dcp") -> its JSON type(s)."""
    defs = schema.get("$defs", {})
    out: dict[str, str] = {}

    def resolve(node: dict) -> tuple[dict, str | None]:
        ref = node.get("$ref")
        return (defs[ref.rsplit("/", 1)[-1]], ref.rsplit("/", 1)[-1]) if ref else (node, None)

    def kind(node: dict) -> str:
        node, _ = resolve(node)
        if "anyOf" in node:
            return "|".join(sorted({kind(o) for o in node["anyOf"]}))
        t = node.get("type", "const" if "const" in node else "any")
        return "|".join(t) if isinstance(t, list) else t

    def walk(node: dict, path: str, seen: tuple) -> None:
        if path:
            out.setdefault(path, kind(node))
        node, name = resolve(node)
        if name in seen:
            return
        seen = (*seen, name) if name else seen
        for option in node.get("anyOf", []):
            walk(option, path, seen)
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{key}" if path else key, seen)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]", seen)

    walk(schema, "", ())
    return out


def incompatible(old: dict, new: dict) -> list[str]:
    """Keys of `old` that `new` dropped or retyped (what breaks a reader of old's version)."""
    a, b = key_paths(old), key_paths(new)
    return [f"{p}: removed or renamed" if p not in b else f"{p}: type {a[p]} -> {b[p]}" for p in sorted(a)
            if p not in b or a[p] != b[p]]


def dumps(schema: dict) -> str:
    return json.dumps(schema, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qual.schema", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {COMMITTED.relative_to(COMMITTED.parents[2])} "
                        f"and {SWEEP_COMMITTED.relative_to(SWEEP_COMMITTED.parents[2])}")
    parser.add_argument("--sweep", action="store_true", help="print a sweep's result.json schema")
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(dumps(sweep_schema() if args.sweep else result_schema()))
        return 0
    targets = ((COMMITTED, result_schema(), "qual.result.SCHEMA"),
               (SWEEP_COMMITTED, sweep_schema(), "qual.sweep_result.SWEEP_SCHEMA"))
    for path, schema, constant in targets:  # every schema checked before any is written
        old = read_json(path, MAX_SCHEMA_BYTES, "JSON Schema") if path.is_file() else {}
        broken = incompatible(old, schema) if old else []
        if broken and old.get("$id") == schema["$id"]:
            print(f"refused: {len(broken)} key(s) of {schema['$id']} would break (extend, never rename; bump "
                  f"{constant} only if you must): " + "; ".join(broken[:10]), file=sys.stderr)
            return 1
    for path, schema, _ in targets:
        write_text(path, dumps(schema))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
