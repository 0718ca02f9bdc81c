"""qual/data/result.schema.json (docs/result.schema.json links to it): generated from the records, current,
validating, never broken within a version, and printed by `qual schema`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qual import schema as schema_mod
from qual.result import save_result
from qual.schema import COMMITTED, SWEEP_COMMITTED, incompatible, key_paths, result_schema, sweep_schema
from synthetic import synthetic_result


def test_committed_schema_is_the_generated_one():
    assert json.loads(COMMITTED.read_text()) == result_schema(), \
        "qual/data/result.schema.json is stale: run `python -m qual.schema --write`"


def test_docs_links_to_the_one_copy():
    docs = Path(__file__).resolve().parents[1] / "docs" / "result.schema.json"
    assert docs.is_symlink() and docs.resolve() == COMMITTED.resolve()


def test_the_committed_sweep_schema_is_the_generated_one_and_docs_link_to_it():
    assert json.loads(SWEEP_COMMITTED.read_text()) == sweep_schema(), \
        "qual/data/result.sweep.schema.json is stale: run `python -m qual.schema --write`"
    docs = Path(__file__).resolve().parents[1] / "docs" / "result.sweep.schema.json"
    assert docs.is_symlink() and docs.resolve() == SWEEP_COMMITTED.resolve()
    assert incompatible(json.loads(SWEEP_COMMITTED.read_text()), sweep_schema()) == []


def test_a_sweep_result_holds_the_control_once_and_each_candidates_keys(tmp_path, sweep_schema_validator):
    """A sweep's result.json: per comparison the keys a single result.json has for its candidate (gate, comparison,
    the candidate arm, warnings), the control arm once; it validates, and every key it writes is in its schema."""
    from qual.result import Result
    from qual.sweep_result import SweepResult, load_any, save_sweep

    one, two = synthetic_result(6, 0.75, 0.7), synthetic_result(6, 0.75, 0.4)
    sweep = SweepResult.of([("candidate-dcp2", one), ("candidate-dcp4", Result(**{**one.__dict__, "candidate": two.candidate,
                                                                                   "comparison": two.comparison,
                                                                                   "gate": two.gate}))])
    data = json.loads(save_sweep(sweep, tmp_path / "result.json").read_text())
    assert not list(sweep_schema_validator.iter_errors(data))
    assert data["schema"] == "qual.result.sweep/1" and data["control"] == one.to_json()["arms"]["control"]
    single = one.to_json()
    first = data["comparisons"][0]
    assert first["gate"] == single["gate"] and first["comparison"] == single["comparison"]
    assert first["candidate"] == single["arms"]["candidate"] and first["warnings"] == single["warnings"]
    names = set(key_paths(sweep_schema()))
    for key in ("control.per_request[].output_token_ids", "comparisons[].candidate.config.dcp",
                "comparisons[].gate.checks[].passed", "comparisons[].comparison.delta_rate_ci95", "passed", "notes"):
        assert key in names, key
    back = load_any(tmp_path / "result.json")
    assert isinstance(back, SweepResult) and back.to_json() == sweep.to_json()


def test_qual_schema_prints_the_generated_schema(capsys):
    import jsonschema

    from qual.cli.main import _register, run_app

    _register()
    assert run_app(["schema"]) == 0
    printed = capsys.readouterr().out
    assert printed == schema_mod.dumps(result_schema())
    jsonschema.Draft202012Validator.check_schema(json.loads(printed))
    assert run_app(["schema", "--sweep"]) == 0
    assert capsys.readouterr().out == schema_mod.dumps(sweep_schema())


def test_no_key_of_the_committed_schema_is_renamed_or_removed():
    assert incompatible(json.loads(COMMITTED.read_text()), result_schema()) == []


def _renamed_config_schema() -> dict:
    """The schema a qual would generate whose ArmConfig spelled `dcp` as `dcp_size`."""
    schema = result_schema()
    props = schema["$defs"]["ArmConfig"]["properties"]
    schema["$defs"]["ArmConfig"]["properties"] = {("dcp_size" if k == "dcp" else k): v for k, v in props.items()}
    return schema


def test_a_renamed_key_is_caught():
    broken = incompatible(json.loads(COMMITTED.read_text()), _renamed_config_schema())
    assert "arms.control.config.dcp: removed or renamed" in broken
    assert "arms.candidate.config.dcp: removed or renamed" in broken


def test_write_refuses_to_break_the_committed_schema(monkeypatch, tmp_path, capsys):
    committed = tmp_path / "result.schema.json"
    committed.write_text(COMMITTED.read_text())
    monkeypatch.setattr(schema_mod, "COMMITTED", committed)
    monkeypatch.setattr(schema_mod, "result_schema", _renamed_config_schema)
    assert schema_mod.main(["--write"]) == 1
    assert "arms.control.config.dcp: removed or renamed" in capsys.readouterr().err
    assert committed.read_text() == COMMITTED.read_text()


def test_the_schema_names_every_key_a_result_writes(tmp_path, result_schema_validator):
    """Keys the writer emits and the schema does not name would validate (extra keys are allowed) but would not be
    protected against renaming: every key of a full result must be in the schema."""
    data = json.loads(save_result(synthetic_result(6, 0.75, 0.7), tmp_path / "result.json").read_text())
    names = set(key_paths(result_schema()))
    free = {"arms.control.config.extra", "arms.candidate.config.extra", "arms.control.extra", "arms.candidate.extra",
            "comparison.delta_rate_ci", "arms.control.graph_capture.backend", "arms.candidate.graph_capture.backend"}

    def paths(value, prefix=""):
        if isinstance(value, dict):
            if prefix in free:
                return
            for k, v in value.items():
                yield f"{prefix}.{k}" if prefix else k
                yield from paths(v, f"{prefix}.{k}" if prefix else k)
        elif isinstance(value, list):
            for v in value:
                yield from paths(v, f"{prefix}[]")

    assert sorted(set(paths(data)) - names) == []
    assert not list(result_schema_validator.iter_errors(data))


@pytest.mark.parametrize("break_it", [
    lambda d: d["arms"]["control"].pop("acceptance"),
    lambda d: d["arms"]["candidate"]["config"].update(dcp="4"),
    lambda d: d["gate"]["checks"][0].update(passed="yes"),
    lambda d: d.update(schema="qual.result/2"),
])
def test_a_broken_result_does_not_validate(tmp_path, result_schema_validator, break_it):
    data = synthetic_result(4).to_json()
    assert not list(result_schema_validator.iter_errors(data))
    break_it(data)
    assert list(result_schema_validator.iter_errors(data))


def _properties(node, where: str = ""):
    """(path, schema) of every property the node declares, nested objects included (definitions are walked apart)."""
    for key, prop in (node.get("properties") or {}).items():
        yield f"{where}.{key}" if where else key, prop
        yield from _properties(prop, f"{where}.{key}" if where else key)
    for option in node.get("anyOf", []):
        yield from _properties(option, where)
    if isinstance(node.get("items"), dict):
        yield from _properties(node["items"], f"{where}[]")


def _numeric(node, defs) -> bool:
    """Whether a property holds numbers: itself, its items, its values or one of its options."""
    node = defs[node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node and len(node) == 1 else node
    types = node.get("type", [])
    if {"number", "integer"} & set(types if isinstance(types, list) else [types]):
        return True
    inner = [node.get("items"), node.get("additionalProperties"), *node.get("anyOf", [])]
    return any(isinstance(n, dict) and "$ref" not in n and _numeric(n, defs) for n in inner)


@pytest.mark.parametrize("generate", [result_schema, sweep_schema], ids=["result", "sweep"])
def test_every_property_says_what_it_holds_and_every_number_its_unit(generate):
    """result.json documented by construction: every record and every property of the schema has a description (the
    field's docstring), and every number's ends with its unit in brackets, one of the units the schema's top says."""
    schema = generate()
    units = "|".join(re.escape(u) for u in schema_mod.UNITS)
    assert all(f"[{u}]" in schema["description"] for u in schema_mod.UNITS)
    nodes = [("", schema), *schema["$defs"].items()]
    assert [name for name, node in nodes[1:] if not node.get("description")] == []
    props = [(f"{name}:{path}" if name else path, prop) for name, node in nodes for path, prop in _properties(node)]
    assert len(props) > 200
    assert [path for path, prop in props if not prop.get("description")] == []
    unitless = [path for path, prop in props if _numeric(prop, schema["$defs"])
                and not re.search(rf"\[({units})\]$", prop["description"])]
    assert unitless == []


def test_a_duplicate_kept_for_compatibility_is_marked_deprecated():
    comparison = result_schema()["$defs"]["Comparison"]["properties"]
    assert comparison["delta_rate_ci95"]["deprecated"] is True and "delta_rate_ci" in comparison["delta_rate_ci95"][
        "description"]
    assert not comparison["delta_rate_ci"].get("deprecated")
