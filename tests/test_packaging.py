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


def test_the_wheel_maps_the_root_folders_into_the_package(wheel):
    """configs/ and corpora/ at the repository's top are in the wheel as qual/data/configs and qual/data/corpora,
    byte for byte: one copy in the repository, mapped by the build."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for folder in ("configs", "corpora"):
            files = [p for p in (ROOT / folder).rglob("*") if p.is_file()]
            assert files
            for path in files:
                inside = f"qual/data/{path.relative_to(ROOT)}"
                assert inside in names and archive.read(inside) == path.read_bytes()
        assert "qual/data/models/toy/target/model.safetensors" in names and "qual/report/templates/report.html.j2" in names


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
    # The root folders, mapped into the package by the build: found there, and said so.
    site = next((venv / "lib").glob("python3*/site-packages")) / "qual" / "data"
    listing = sh(venv / "bin" / "qual", "corpus", "list", cwd=work, env={**env, "COLUMNS": "250"}).stdout
    assert f"{site / 'corpora'} (package)" in listing
    assert all(line.rstrip(" │").endswith("package") for line in listing.splitlines() if "│ humaneval" in line)
    dry = sh(venv / "bin" / "qual", "run", "--dry-run", "--history", tmp_path / "h.sqlite", cwd=work, env=env).stdout
    assert f"# gate file: {site / 'configs' / 'gates' / 'nightly.yaml'} (package)" in dry
    # An import never writes into the installed package: without QUAL_ROOT or --into, one line says what to pass.
    src = work / "rows.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "p"}) + "\n")
    refused = subprocess.run([venv / "bin" / "qual", "corpus", "import", src, "--name", "x"], cwd=work,
                             capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 2 and "pass --into DIR, or set QUAL_ROOT" in refused.stderr, refused.stderr
    assert not (site / "corpora" / "x.jsonl").exists()
    sh(venv / "bin" / "qual", "corpus", "import", src, "--name", "x", "--into", work / "corpora", cwd=work, env=env)
    assert (work / "corpora" / "x.jsonl").is_file()
