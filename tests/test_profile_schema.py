"""`qual schema --profile`: a model profile's JSON Schema, generated from the models qual validates profiles with
(ModelProfile and each engine's section), so the printed schema and the loader agree on every shipped profile."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from qual import paths
from qual.profiles import load_profile, profile_schema


def _properties(node, where=""):
    for key, prop in (node.get("properties") or {}).items():
        yield f"{where}.{key}" if where else key, prop
        yield from _properties(prop, f"{where}.{key}" if where else key)


def test_every_key_says_what_it_does():
    schema = profile_schema()
    props = list(_properties(schema))
    assert {"engine", "device", "gpu_memory_gib", "vllm.attention_backend", "reference.backend",
            "attach.request_timeout_s"} <= {p for p, _ in props}
    assert [path for path, prop in props if not prop.get("description")] == []
    assert "path" not in schema["properties"] and "name" not in schema["required"]


@pytest.mark.parametrize("name", sorted(paths.available("profile")))
def test_every_shipped_profile_validates_against_the_schema_and_loads(name):
    data = yaml.safe_load(paths.find("profile", name).path.read_text())
    jsonschema.Draft202012Validator(profile_schema()).validate(data)
    assert load_profile(name).name == name


@pytest.mark.parametrize("change", [{"flavour": 1}, {"vllm": {"warp": 9}}, {"engine": "warp"},
                                    {"reference": {"block_size": 0}}])
def test_a_key_the_loader_refuses_the_schema_refuses(tmp_path, change):
    from qual.errors import QualError

    data = {**yaml.safe_load(paths.find("profile", "toy").path.read_text()), **change}
    assert list(jsonschema.Draft202012Validator(profile_schema()).iter_errors(data))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(QualError):
        load_profile(str(path))


def test_qual_schema_prints_it(capsys):
    from qual.cli.main import _register, run_app

    _register()
    assert run_app(["schema", "--profile"]) == 0
    assert json.loads(capsys.readouterr().out) == profile_schema()
    assert run_app(["schema", "--profile", "--sweep"]) == 2
