"""`qual doctor`: exit 0 whatever it finds (compatibility), exit 1 under --strict when a check says no."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import qual.cli.doctor as doctor
from qual.cli.main import _register, app
from qual.records import DoctorCheck

YES = DoctorCheck("Python", "yes", "3.11")
UNKNOWN = DoctorCheck("replicated draft KV", "unknown", "partial mechanism", ["dcp_sharded found"])
NO = DoctorCheck("GPUs", "no", "no CUDA device")


@pytest.fixture
def checks(monkeypatch):
    _register()
    found: list[DoctorCheck] = []
    monkeypatch.setattr(doctor, "collect_checks", lambda: list(found))
    return found


@pytest.mark.parametrize("args", [[], ["--json"], ["--verbose"]])
def test_without_strict_a_failed_check_still_exits_0(checks, args):
    checks += [YES, NO]
    got = CliRunner().invoke(app, ["doctor", *args])
    assert got.exit_code == 0, got.output


@pytest.mark.parametrize("found,code", [([YES], 0), ([YES, UNKNOWN], 0), ([YES, NO, UNKNOWN], 1)],
                         ids=["all-yes", "an-unknown", "a-no"])
def test_strict_exits_1_when_a_check_says_no(checks, found, code):
    checks += found
    got = CliRunner().invoke(app, ["doctor", "--strict"])
    assert got.exit_code == code, got.output
    assert "✗ GPUs" in got.stdout if code else "✗" not in got.stdout
    if code:
        assert got.stderr.strip() == "doctor --strict: 1 check(s) failed: GPUs"


def test_strict_with_json_keeps_stdout_json(checks):
    checks += [YES, NO]
    got = CliRunner().invoke(app, ["doctor", "--strict", "--json"])
    assert got.exit_code == 1
    assert [c["verdict"] for c in json.loads(got.stdout)] == ["yes", "no"]


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
    assert "not here: triton-gemm, triton-attention, fused, pdl" in check.detail
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
