"""Each arm's provenance (qual.provenance, qual.harness.build) and `qual compare`'s warnings where it differs."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

import qual
from qual.harness.build import build_result, provenance_differences
from qual.paths import default_gate, source_checkout
from qual.provenance import local_host
from qual.records import EngineBuild, HostFacts
from qual.result import CorpusInfo, load_result, save_result
from synthetic import synthetic_arm_config, synthetic_pair, synthetic_result, synthetic_run_info

H200 = HostFacts(gpus=["NVIDIA H200"] * 2, torch="2.13.0+cu130", cuda="13.0", gpu_driver="580.1", source="test")
B200 = replace(H200, gpus=["NVIDIA B200"] * 2)


def _result(tmp_path, control_build, candidate_build, candidate_dtype="float32", numerics=(None, None)):
    control, candidate = synthetic_pair(8, 0.75, 0.75)
    corpus = CorpusInfo("synthetic", "corpora/synthetic.jsonl", "sha256:" + "cd" * 32, len(control))
    return build_result(corpus,
                        (synthetic_arm_config(1, numerics=numerics[0]), replace(synthetic_run_info(control),
                                                                                build=control_build), control),
                        (synthetic_arm_config(4, dtype=candidate_dtype, numerics=numerics[1]),
                         replace(synthetic_run_info(candidate), build=candidate_build), candidate),
                        default_gate(), 0, n_resamples=50)


def test_every_arm_records_where_it_came_from(tmp_path):
    build = EngineBuild("vllm", "0.32.0", None, H200, server_command="vllm serve X", source="test")
    res = _result(tmp_path, build, build)
    data = json.loads(save_result(res, tmp_path / "result.json").read_text())
    for arm in ("control", "candidate"):
        p = data["arms"][arm]["provenance"]
        assert p["qual_version"] == qual.__version__
        if source_checkout() is not None and (source_checkout() / ".git").exists():
            head = subprocess.run(["git", "-C", str(source_checkout()), "rev-parse", "HEAD"], capture_output=True,
                                  text=True).stdout.strip()
            assert p["qual_commit"] == head and isinstance(p["qual_checkout_dirty"], bool)
        assert p["gate_sha256"] == "sha256:" + hashlib.sha256(default_gate().read_bytes()).hexdigest()
        assert p["corpus_fingerprint"] == "sha256:" + "cd" * 32
        assert p["host"]["hostname"] == local_host().hostname and p["host"]["torch"]
        assert p["host"]["cpu_model"] or p["host"]["gpus"]
        assert p["engine"]["host"]["gpus"] == ["NVIDIA H200"] * 2 and p["engine"]["server_command"] == "vllm serve X"
    assert data["warnings"] == []
    assert load_result(tmp_path / "result.json").to_json() == res.to_json()  # round trip


def test_an_engine_without_build_facts_still_gets_provenance():
    res = synthetic_result(4)
    p = res.control.provenance
    assert p.engine.name == "reference" and p.engine.version == "qual-reference 0.1.0"
    assert "no build facts" in p.engine.source


@pytest.mark.parametrize("control,candidate,dtype,expected", [
    (EngineBuild("vllm", "0.32.0", host=H200), EngineBuild("vllm", "0.33.0", host=H200), "float32",
     ["engine version differs: control 0.32.0, candidate 0.33.0"]),
    (EngineBuild("vllm", "0.32.0", host=H200), EngineBuild("vllm", "0.32.0", host=B200), "float32",
     ["GPU type differs: control NVIDIA H200, candidate NVIDIA B200"]),
    (EngineBuild("vllm", "0.32.0", host=H200), EngineBuild("vllm", "0.32.0", host=H200), "bfloat16",
     ["dtype differs: control float32, candidate bfloat16"]),
    (EngineBuild("vllm", "0.32.0", host=H200), EngineBuild("vllm", "0.32.0", host=None), "float32", []),  # unknown
    (EngineBuild("reference", "0.1.0", host=H200), EngineBuild("vllm", "0.32.0", host=H200), "float32",
     ["engine differs: control reference 0.1.0, candidate vllm 0.32.0"]),
])
def test_differences_that_matter_are_warnings(tmp_path, control, candidate, dtype, expected):
    assert _result(tmp_path, control, candidate, dtype).warnings == expected


def test_arms_of_other_numerics_are_warned_about(tmp_path):
    """`qual compare` of an exact arm and a vllm one (how the effect of vLLM's numerics is measured) says so."""
    build = EngineBuild("reference", "0.1.0", host=H200)
    assert _result(tmp_path, build, build, numerics=("exact", "vllm")).warnings == [
        "numerics differ: control exact, candidate vllm"]
    assert _result(tmp_path, build, build, numerics=("exact", "exact")).warnings == []


def test_compare_keeps_each_runs_provenance_and_warns_on_stderr(tmp_path, capsys):
    from qual.cli.main import main

    a = _result(tmp_path, EngineBuild("vllm", "0.32.0", host=H200), EngineBuild("vllm", "0.32.0", host=H200))
    b = _result(tmp_path, EngineBuild("vllm", "0.33.0", host=B200), EngineBuild("vllm", "0.33.0", host=B200))
    for res, node in ((a, "node-a"), (b, "node-b")):  # produced elsewhere: this machine must not claim them
        res.control.provenance.host = replace(res.control.provenance.host, hostname=node)
        res.control.provenance.qual_commit = "0" * 40
    save_result(a, tmp_path / "a" / "result.json")
    save_result(b, tmp_path / "b" / "result.json")
    argv, handler = sys.argv, signal.getsignal(signal.SIGTERM)
    sys.argv = ["qual", "compare", f"{tmp_path / 'a'}:control", f"{tmp_path / 'b'}:control", "--out", str(tmp_path / "c")]
    try:
        with pytest.raises(SystemExit) as exit_:
            main()
    finally:
        sys.argv = argv
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert exit_.value.code == 0, err
    assert "warning: engine version differs: control 0.32.0, candidate 0.33.0" in err
    assert "warning: GPU type differs: control NVIDIA H200, candidate NVIDIA B200" in err
    got = load_result(tmp_path / "c" / "result.json")
    assert got.control.provenance == a.control.provenance and got.candidate.provenance == b.control.provenance
    assert len(got.warnings) == 2
    assert "engine version differs" in (tmp_path / "c" / "report.html").read_text()
    assert "engine version differs" in (tmp_path / "c" / "summary.md").read_text()


def test_results_without_provenance_say_so():
    res = synthetic_result(4)
    res.control.provenance = None
    assert provenance_differences(res.control, res.candidate) == [
        "provenance not recorded for the control arm (a result written before qual recorded it)"]


def test_arms_of_two_models_say_so_in_the_warnings_and_the_title(tmp_path):
    """qual compare joins arms of any two runs: arms that ran other target or drafter checkpoints are warned about
    (by the files' digest where recorded, else the path), and the title names both models instead of claiming a
    DCP 1 -> DCP 4 comparison of one."""
    from qual.harness.build import checkpoint_differences
    from qual.report.common import title

    build = EngineBuild("reference", "0.1.0", host=H200)
    res = _result(tmp_path, build, build)
    assert checkpoint_differences(res.control, res.candidate) == [] and title(res).startswith("toy: DCP 1 \u2192 DCP 4")
    res.candidate.config.update(model="glm-toy", target_path="models/glm-toy/target", draft_path="models/glm-toy/draft")
    res.control.provenance.checkpoints = res.candidate.provenance.checkpoints = None  # older results: paths speak
    assert provenance_differences(res.control, res.candidate)[:2] == [
        "target differs: control toy (models/toy/target), candidate glm-toy (models/glm-toy/target)",
        "drafter differs: control toy (models/toy/draft), candidate glm-toy (models/glm-toy/draft)"]
    assert title(res).startswith("toy DCP 1 \u2192 glm-toy DCP 4 (")
    digest = {"path": "elsewhere/toy/target", "revision": None, "identity": "sha256:" + "ab" * 32}
    for arm in (res.control, res.candidate):  # the same files at two paths: not a difference
        arm.provenance.checkpoints = {"target": digest, "draft": None}
        arm.config.update(draft_path="models/toy/draft")
    assert checkpoint_differences(res.control, res.candidate) == []
