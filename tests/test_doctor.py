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
