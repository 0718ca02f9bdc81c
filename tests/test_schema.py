"""qual/data/result.schema.json (docs/result.schema.json links to it): generated from the records, current,
validating, never broken within a version, and printed by `qual schema`."""

from __future__ import annotations

import json
import typing
from dataclasses import make_dataclass
from pathlib import Path

import pytest

from qual import schema as schema_mod
from qual.records import ArmConfig
from qual.result import ArmResult, save_result
from qual.schema import COMMITTED, incompatible, key_paths, result_schema
from synthetic import synthetic_result


def test_committed_schema_is_the_generated_one():
    assert json.loads(COMMITTED.read_text()) == result_schema(), \
        "qual/data/result.schema.json is stale: run `python -m qual.schema --write`"


def test_docs_links_to_the_one_copy():
    docs = Path(__file__).resolve().parents[1] / "docs" / "result.schema.json"
    assert docs.is_symlink() and docs.resolve() == COMMITTED.resolve()


def test_qual_schema_prints_the_generated_schema(capsys):
    import jsonschema

    from qual.cli.main import _register, run_app

    _register()
    assert run_app(["schema"]) == 0
    printed = capsys.readouterr().out
    assert printed == schema_mod.dumps(result_schema())
    jsonschema.Draft202012Validator.check_schema(json.loads(printed))


def test_no_key_of_the_committed_schema_is_renamed_or_removed():
    assert incompatible(json.loads(COMMITTED.read_text()), result_schema()) == []


def _renamed_config_schema(monkeypatch) -> dict:
    """The schema a qual would generate whose ArmConfig spelled `dcp` as `dcp_size`."""
    fields = [("dcp_size" if f == "dcp" else f, t) for f, t in typing.get_type_hints(ArmConfig).items()]
    renamed = make_dataclass("ArmConfig", fields)
    monkeypatch.setitem(schema_mod.JSON_FORM, (ArmResult, "config"), renamed)
    return result_schema()


def test_a_renamed_key_is_caught(monkeypatch):
    broken = incompatible(json.loads(COMMITTED.read_text()), _renamed_config_schema(monkeypatch))
    assert "arms.control.config.dcp: removed or renamed" in broken
    assert "arms.candidate.config.dcp: removed or renamed" in broken


def test_write_refuses_to_break_the_committed_schema(monkeypatch, tmp_path, capsys):
    committed = tmp_path / "result.schema.json"
    committed.write_text(COMMITTED.read_text())
    monkeypatch.setattr(schema_mod, "COMMITTED", committed)
    _renamed_config_schema(monkeypatch)
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
