"""`qual doctor`: exit 0 whatever it finds (compatibility), exit 1 under --strict when a check the run needs says no;
`--model M [--engine E]`: what that run lacks here (the plan's refusals), and the memory a GPU needs."""

from __future__ import annotations

import json
import re
from dataclasses import fields

import pytest
from typer.testing import CliRunner

import qual.cli.doctor as doctor
from qual.cli.main import _register, app
from qual.records import DoctorCheck

YES = DoctorCheck("Python", "yes", "3.11")
UNKNOWN = DoctorCheck("replicated draft KV", "unknown", "partial mechanism", ["dcp_sharded found"])
NO = DoctorCheck("GPUs", "no", "no CUDA device")
UNNEEDED = DoctorCheck("DFlash context-key norm per layer", "no", "the k_norm CPU bug", ["layer0"], needed=False)


@pytest.fixture
def checks(monkeypatch):
    _register()
    found: list[DoctorCheck] = []
    monkeypatch.setattr(doctor, "collect_checks", lambda plan, model_given: list(found))
    return found


@pytest.mark.parametrize("args", [[], ["--json"], ["--verbose"]])
def test_without_strict_a_failed_check_still_exits_0(checks, args):
    checks += [YES, NO]
    got = CliRunner().invoke(app, ["doctor", *args])
    assert got.exit_code == 0, got.output


@pytest.mark.parametrize("found,code", [([YES], 0), ([YES, UNKNOWN], 0), ([YES, NO, UNKNOWN], 1), ([YES, UNNEEDED], 0),
                                        ([YES, NO, UNNEEDED], 1)],
                         ids=["all-yes", "an-unknown", "a-no", "a-no-the-run-does-not-need", "both"])
def test_strict_exits_1_when_a_check_the_run_needs_says_no(checks, found, code):
    checks += found
    got = CliRunner().invoke(app, ["doctor", "--strict"])
    assert got.exit_code == code, got.output
    assert "✗ GPUs" in got.stdout if code else "✗" not in got.stdout
    if UNNEEDED in found:  # shown with its own mark and its evidence
        assert "– DFlash context-key norm per layer  the k_norm CPU bug  (not needed by this run)" in got.stdout
        assert "layer0" in got.stdout
    if code:
        assert got.stderr.strip() == "doctor --strict: 1 check(s) failed: GPUs"


def test_strict_names_each_failed_check_once(checks):
    """A run's part (indented under its check) is named with it: the machine's GPUs and the run's are two checks."""
    checks += [NO, DoctorCheck("run", "no", "qual run --model m: 2 thing(s) missing"),
               DoctorCheck("  GPUs", "no", "4 needed, none found"), DoctorCheck("  vLLM", "no", "not installed")]
    got = CliRunner().invoke(app, ["doctor", "--strict"])
    assert got.exit_code == 1, got.output
    assert got.stderr.strip() == "doctor --strict: 4 check(s) failed: GPUs, run, run: GPUs, run: vLLM"


def test_strict_with_json_keeps_stdout_json(checks):
    checks += [YES, NO]
    got = CliRunner().invoke(app, ["doctor", "--strict", "--json"])
    assert got.exit_code == 1
    assert [c["verdict"] for c in json.loads(got.stdout)] == ["yes", "no"]


def test_the_json_list_follows_the_schema_qual_schema_prints_for_it(checks):
    """`qual doctor --json` stays a bare list (scripts read it so); `qual schema --doctor` names it (qual.doctor/1) and
    describes every key of every check, and what doctor prints validates against it (a check without a key, or with a
    verdict outside yes/no/unknown, does not)."""
    import jsonschema

    checks += [YES, NO, DoctorCheck("  vLLM", "unknown", "cannot tell", ["no build facts"], install="vllm 0.32")]
    printed = CliRunner().invoke(app, ["doctor", "--json"])
    assert printed.exit_code == 0, printed.output
    listed = json.loads(printed.stdout)
    schema = json.loads(CliRunner().invoke(app, ["schema", "--doctor"]).stdout)
    assert isinstance(listed, list) and schema["$id"] == doctor.DOCTOR_SCHEMA == "qual.doctor/1"
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate(listed)
    props = schema["$defs"]["DoctorCheck"]["properties"]
    assert set(props) == {f.name for f in fields(DoctorCheck)} == set(listed[0])
    assert all(p.get("description") for p in props.values())
    assert not validator.is_valid([{**listed[0], "verdict": "maybe"}])
    assert not validator.is_valid([{k: v for k, v in listed[0].items() if k != "detail"}])


def test_the_runtime_backends_line_names_the_parts_that_cannot_run_here_and_why():
    """On this CPU machine: torch.compile's parts run; the kernel parts are named with the refusal a run would get
    (the reference engine's line)."""
    import torch

    from qual.runtime.backends import PARTS, part_problems

    if torch.cuda.is_available():
        pytest.skip("checks the CPU's answers")
    problems = part_problems("cpu")
    assert list(problems) == list(PARTS)
    assert [p for p, why in problems.items() if why is None] == ["compiled", "compiled-autotune", "compiled-prefill"]
    assert "fused need device cuda (got cpu)" in problems["fused"]
    check = next(c for c in doctor.collect_checks() if c.name == "runtime backends")
    assert check.verdict == "yes" and check.detail.startswith("pytorch and compiled, compiled-autotune, compiled-prefill;")
    assert "not here: triton-gemm, triton-attention, fused-layer, gluon-layer, fused, pdl" in check.detail
    assert check.evidence[0] == "triton-gemm: " + problems["triton-gemm"]


def test_a_gpu_query_that_fails_is_a_reason_not_a_crash(monkeypatch):
    """A driver that fails the capability query makes pdl's line say so; the other parts are still answered."""
    import torch

    from qual.runtime import backends

    def broken(device):
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "get_device_capability", broken)
    problems = backends.part_problems("cuda")
    assert problems["pdl"] == "RuntimeError: CUDA driver initialization failed"
    assert "need device cuda" not in str(problems)  # asked as a GPU machine


def test_strict_passes_for_the_default_run_on_this_machine():
    """The default run (the toy pair on the embedded runtime, on the CPU) runs here, so nothing it needs says no: the
    missing GPU and the unpatched vLLM kept beside the patched one are shown and not counted."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU machine's answers")
    _register()
    got = CliRunner().invoke(app, ["doctor", "--strict", "--json"])
    assert got.exit_code == 0, got.output
    checks = {c["name"]: c for c in json.loads(got.stdout)}
    assert checks["GPUs"]["verdict"] == "no" and not checks["GPUs"]["needed"]
    assert checks["run"]["verdict"] == "yes" and checks["run"]["detail"].startswith(
        "qual run (the default run): --engine reference --device cpu, qual's default; control DCP 1, candidate DCP 4")


def test_model_says_what_its_run_lacks_here_and_the_memory_a_gpu_needs(tmp_path):
    """`qual doctor --model glm-5.3-flash` on a machine without GPUs, vLLM or weights (described by the test): the run
    line says no, one line a thing missing (the run's own refusals), and the memory a GPU needs; --strict fails."""
    from machines import NO_GPUS
    from qual.harness.plan import make_plan, run_options

    plan = make_plan(run_options(model="glm-5.3-flash", history=str(tmp_path / "h.sqlite")), dry_run=True,
                     inventory=NO_GPUS)
    checks = {c.name: c for c in doctor.collect_checks(plan, True)}
    run = checks["run"]
    assert run.verdict == "no" and run.detail == ("qual run --model glm-5.3-flash: --engine vllm --device cuda, the "
                                                  "profile's; control DCP 1, candidate DCP 4, TP 4; 3 thing(s) missing")
    assert [name for name in checks if name.startswith("  ")][-4:] == ["  GPUs", "  vLLM", "  weights", "  memory a GPU"]
    assert checks["  GPUs"].detail == "4 needed (one a TP rank) with 85.0 GiB each (the profile's gpu_memory_gib), none found"
    assert checks["  memory a GPU"].detail.startswith("85 GiB: the profile's gpu_memory_gib")
    assert checks["GPUs"].needed and checks["runtime backends"].needed is False  # a vLLM run on GPUs


@pytest.mark.parametrize("args,code,lines", [
    (["--model", "glm-5.3-flash"], 1, [r"✗ run +qual run --model glm-5.3-flash: --engine vllm", r"✗   weights +"]),
    (["--model", "glm-toy"], 0, [r"✓ run +qual run --model glm-toy: --engine reference --device cpu, qual's default"]),
    (["--model", "nope"], 2, []),
])
def test_strict_with_a_model(monkeypatch, capsys, args, code, lines):
    """Without a GPU, vLLM or weights, glm-5.3-flash's run is refused here (exit 1 under --strict); the GLM-shaped
    toy's runs; an unknown profile is a usage error. The vLLM installs' own checks are stubbed (seconds each)."""
    import torch

    from qual.cli.main import run_app
    from qual.engines.vllm import engine as vllm_engine

    if torch.cuda.is_available():
        pytest.skip("the CPU machine's answers")
    monkeypatch.setattr(vllm_engine.VllmEngine, "doctor", classmethod(lambda cls: []))
    _register()
    assert run_app(["doctor", "--strict", *args]) == code
    out = capsys.readouterr()
    for line in lines:
        assert any(re.match(line, x) for x in out.out.splitlines()), out.out
    assert "error: unknown model 'nope'" in out.err if code == 2 else not out.err.startswith("error")
    if code == 1:  # the machine's GPUs check and the run's: each named once
        assert out.err.strip() == "doctor --strict: 5 check(s) failed: GPUs, run, run: GPUs, run: vLLM, run: weights"
