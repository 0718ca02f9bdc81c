"""The configuration key (qual.configuration) and each night's facts beside it (qual.nights)."""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace

import pytest

from qual.configuration import (NO_IDENTITY, SUCCESSOR_FIELDS, ConfigurationKey, device_kind, field_names,
                                is_successor)
from qual.errors import QualError
from qual.nights import FACTS, axis_value, changes, check_axis, facts_of, parse_meta
from synthetic import synthetic_arm_config, synthetic_result

FINGERPRINT = "sha256:" + "ab" * 32


def _key(**arm) -> ConfigurationKey:
    return ConfigurationKey.of(synthetic_arm_config(4, **arm).to_json(), FINGERPRINT, 10,
                               {"target": "sha256:" + "01" * 32, "draft": "sha256:" + "02" * 32})


def test_every_field_is_read_from_the_candidate_or_the_run_and_the_software_is_not_in_it():
    key = _key()
    assert field_names() == tuple(f.name for f in fields(ConfigurationKey))
    assert all("source" in f.metadata for f in fields(ConfigurationKey))  # each field says where it comes from
    assert not {"engine_version", "qual_commit", "torch", "gpu", "host"} & set(field_names())
    assert (key.numerics, key.dcp_comm, key.dsa_topk, key.interleave) == ("exact", NO_IDENTITY, "none", 1)  # unsaid
    arm = {**synthetic_arm_config(4, extra={"vllm": {"dcp_comm_backend": "ag_rs"}}, engine="vllm").to_json(),
           "numerics": "vllm-hopper", "device": "cuda:3"}
    read = ConfigurationKey.of(arm, FINGERPRINT, 10, None)
    assert (read.numerics, read.dcp_comm, read.device) == ("vllm-hopper", "ag_rs", "cuda")
    assert read.differences(replace(read, numerics="exact"))[0] == ("numerics", "vllm-hopper", "exact")
    assert "numerics=vllm-hopper merge=ag_rs" in read.label() and "numerics" not in key.label()
    assert (read.target, read.draft) == (NO_IDENTITY, NO_IDENTITY)  # identities not recorded
    assert ConfigurationKey.of({**arm, "draft_path": None}, FINGERPRINT, 10, None).draft == "none"
    assert [device_kind(d) for d in ("cpu", "cuda", "cuda:0", "cuda:12")] == ["cpu", "cuda", "cuda", "cuda"]


def test_a_stored_key_reads_back_whatever_fields_it_was_written_with():
    """A key written before a field joined reads as that field's default; a field that left the key (the engine's
    version) is ignored; so the same experiment recorded before and after is one key."""
    key = _key()
    assert ConfigurationKey.from_key(key.key()) == key
    old = {k: v for k, v in asdict(key).items() if k not in ("numerics", "dcp_comm")}
    old["engine_version"] = "vllm 0.32.0"  # a v4 history's key
    assert ConfigurationKey.from_key(json.dumps(old)) == key
    assert ConfigurationKey.from_key(json.dumps({**old, "device": "cuda:1"})).device == "cuda"


@pytest.mark.parametrize("engine, unsaid", [("reference", "exact"), ("vllm", "build"), ("attach", "build")])
def test_numerics_an_arm_did_not_choose_are_its_engines_and_no_key_claims_exact_for_a_served_build(engine, unsaid):
    """The embedded runtime computes a target as written unless asked; a launched or attached vLLM computes as its
    build's kernels do and refuses --numerics: its key says build, never exact, from a run and from a stored key that
    was written before numerics joined the key."""
    key = _key(engine=engine)
    assert key.numerics == unsaid and "numerics" not in key.label()
    old = {k: v for k, v in asdict(key).items() if k != "numerics"}
    assert ConfigurationKey.from_key(json.dumps(old)) == key
    chosen = ConfigurationKey.of({**synthetic_arm_config(4, engine=engine).to_json(), "numerics": "vllm"},
                                 FINGERPRINT, 10, None)
    assert chosen.numerics == "vllm" and "numerics=vllm" in chosen.label()


@pytest.mark.parametrize("stored, words", [
    ("{}", "no 'model'"),
    ("[1]", "expected a JSON object"),
    ("not json", "Expecting value"),
    (json.dumps({**asdict(_key()), "tp": "4"}), "tp: expected int"),
    (json.dumps({**asdict(_key()), "model": 5}), "model: expected str"),
    (json.dumps({**asdict(_key()), "seed": True}), "seed: expected int"),
    (json.dumps({**asdict(_key()), "temperature": 1e999}), "temperature: Infinity is not a number"),  # the bounded loader
])
def test_a_damaged_stored_key_is_a_value_error_naming_the_field(stored, words):
    with pytest.raises(ValueError, match=words):
        ConfigurationKey.from_key(stored)


def test_a_series_follows_another_that_differs_only_in_checkpoints_or_selection():
    key = _key()
    assert SUCCESSOR_FIELDS == ("target", "draft", "n_requests")
    for name in SUCCESSOR_FIELDS:
        other = replace(key, **{name: 99 if name == "n_requests" else "sha256:" + "ff" * 32})
        assert is_successor(key, other) and is_successor(other, key)
    assert is_successor(key, replace(key, draft="sha256:" + "ff" * 32, n_requests=5))
    assert not is_successor(key, key)  # the same series
    for name in set(field_names()) - set(SUCCESSOR_FIELDS):  # any other field: another experiment
        value = getattr(key, name)
        other = replace(key, **{name: value + 1 if isinstance(value, (int, float)) else f"{value}-other"})
        assert not is_successor(key, other), name


def test_a_nights_facts_and_what_changed_between_two():
    night = synthetic_result(4, n_resamples=10)
    facts = facts_of(night)
    assert set(facts) == set(FACTS) and facts["engine"] == "qual-reference 0.1.0"
    assert facts["qual"].startswith(night.candidate.provenance.qual_version)
    before = {"engine": "vllm 0.32.0", "torch": "2.13.0", "gpu": "H100", "qual": "0.1.0 abc"}
    after = {"engine": "vllm 0.33.0.dev41+g1a2b3c4", "torch": "2.14.0", "gpu": None, "qual": "0.1.0 abc"}
    assert changes(before, after) == ["engine vllm 0.32.0 -> 0.33.0.dev41+g1a2b3c4", "torch 2.13.0 -> 2.14.0"]
    assert changes(before, before) == []
    assert changes({"engine": "qual-reference 0.1.0"}, {"engine": "vllm 0.32.0"}) == [
        "engine qual-reference 0.1.0 -> vllm 0.32.0"]


def test_meta_and_axes():
    assert parse_meta(["ci_run=https://x/y?a=b", "cluster=a=b"]) == {"ci_run": "https://x/y?a=b", "cluster": "a=b"}
    for bad, words in [("novalue", "expected KEY=VALUE"), ("1x=2", "expected KEY=VALUE"), ("k=\x1b[31m", "control"),
                       ("k=" + "x" * 501, "at most 500")]:
        with pytest.raises(QualError, match=words):
            parse_meta([bad])
    with pytest.raises(QualError, match="--meta k: given twice"):
        parse_meta(["k=1", "k=2"])
    for axis in ("date", "engine", "qual", "meta:cluster"):
        assert check_axis(axis) == axis
    with pytest.raises(QualError, match="--axis 'gpu': expected one of date, engine, qual or meta:KEY"):
        check_axis("gpu")
    facts, meta = {"engine": "vllm 0.32.0", "qual": "0.1.0"}, {"cluster": "east"}
    assert [axis_value(a, "2026-12-01", facts, meta) for a in ("date", "engine", "qual", "meta:cluster", "meta:x")] \
        == ["2026-12-01", "vllm 0.32.0", "0.1.0", "east", None]
