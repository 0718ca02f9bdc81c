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


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_from_anywhere(tmp_path):
    dist = tmp_path / "dist"
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, ROOT)
    wheel = next(dist.glob("qual-*.whl"))
    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    # --no-compile: pip would byte-compile every module of torch and the dependencies (~30 s of two cores' time);
    # Python compiles what the run imports anyway.
    sh(py, "-m", "pip", "install", "-q", "--no-compile", TORCH)  # CPU torch first: an unpinned torch pulls CUDA
    sh(py, "-m", "pip", "install", "-q", "--no-compile", wheel)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QUAL_ROOT")}
    proc = subprocess.run([venv / "bin" / "qual", "run", "--dcp", "2", "--limit", "2", "--max-tokens", "8"], cwd=work,
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = list((work / "reports").glob("*-toy-dcp2"))
    assert len(runs) == 1 and (runs[0] / "report.html").is_file() and (work / "reports" / "history.sqlite").is_file()
    result = json.loads((runs[0] / "result.json").read_text())
    assert result["arms"]["candidate"]["config"]["target_path"].startswith(str(venv))  # the toy pair: package data
    assert len(result["arms"]["control"]["per_request"]) == 2
