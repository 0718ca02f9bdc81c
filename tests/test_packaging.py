"""qual installs as a wheel into a fresh venv and runs from an unrelated directory: data from the package,
outputs under the working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = os.environ.get("QUAL_TEST_TORCH", "torch==2.13.0")  # the CPU build this machine's pip takes from disk


def sh(*cmd, cwd=None, timeout=900, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """qual's wheel, built once for the module."""
    dist = tmp_path_factory.mktemp("dist")
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, ROOT)
    return next(dist.glob("qual-*.whl"))


def test_the_wheel_ships_the_result_schema(wheel):
    """result.json's schemas (a run's and a sweep's) are package data: the wheel holds the generated ones, where
    `qual schema [--sweep]` reads them."""
    import zipfile

    from qual.schema import dumps, result_schema, sweep_schema

    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("qual/data/result.schema.json").decode() == dumps(result_schema())
        assert archive.read("qual/data/result.sweep.schema.json").decode() == dumps(sweep_schema())


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_from_anywhere(wheel, tmp_path):
    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    # Nothing of the checkout is seen from the venv: under PYTHONPATH=<checkout> pip would take the checkout's
    # qual.egg-info (left by the wheel build) for an installed qual and skip the wheel.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QUAL_ROOT")}
    # --no-compile: pip would byte-compile every module of torch and the dependencies (~30 s of two cores' time);
    # Python compiles what the run imports anyway.
    sh(py, "-m", "pip", "install", "-q", "--no-compile", TORCH, env=env)  # CPU torch first: unpinned, it pulls CUDA
    sh(py, "-m", "pip", "install", "-q", "--no-compile", wheel, env=env)
    work = tmp_path / "elsewhere"
    work.mkdir()
    proc = subprocess.run([venv / "bin" / "qual", "run", "--dcp", "2", "--limit", "2", "--max-tokens", "8"], cwd=work,
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = list((work / "reports").glob("*-toy-dcp2"))
    assert len(runs) == 1 and (runs[0] / "report.html").is_file() and (work / "reports" / "history.sqlite").is_file()
    result = json.loads((runs[0] / "result.json").read_text())
    assert result["arms"]["candidate"]["config"]["target_path"].startswith(str(venv))  # the toy pair: package data
    assert len(result["arms"]["control"]["per_request"]) == 2
    printed = sh(venv / "bin" / "qual", "schema", cwd=work, env=env).stdout  # the schema, from the package
    assert json.loads(printed)["$id"] == result["schema"]
