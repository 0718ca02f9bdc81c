"""Run `vllm serve` as a child process group: start, wait for /health, check it is ours, stop without leftovers."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from qual.errors import EngineError, QualError
from qual.files import open_append
from qual.engines.vllm.client import answers_health
from qual.engines.vllm.logparse import classify_failure
from qual.proc import group_members, holds_socket, port_listeners
from qual.userfiles import load_reply, read_tail

# Seconds to wait after each signal before escalating (SIGINT lets uvicorn and the engine core shut down).
STOP_GRACE_S = (10.0, 5.0, 5.0)
# The same after an interrupt: the run is being abandoned, and a CI job's grace period is short.
INTERRUPTED_GRACE_S = (0.0, 2.0, 5.0)
GUARD = Path(__file__).with_name("guard.py")  # the launcher that ties the server's group to this process
API_KEY_ENV = "VLLM_API_KEY"
MAX_LOG_BYTES = 1 << 24  # the end of a server's log read for the cause of a failure
MAX_MODELS_REPLY_BYTES = 1 << 20  # /v1/models: a list of a few served names


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on host (the server binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def exit_description(returncode: int) -> str:
    """"exit code 1" or "killed by signal 9 (SIGKILL)"."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"killed by signal {-returncode}"
    return f"killed by signal {-returncode} ({name})"


class VllmServer:
    """One `vllm serve` process group; a context manager that always stops it.

    The server gets a random API key through its environment (never its command line, which qual logs and
    reports), dies with this process (guard.py), and is accepted as healthy only once it proves to be the
    process this object started.
    """

    def __init__(
        self,
        argv: list[str],
        log_path: Path,
        port: int,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        served_model_name: str | None = None,
    ):
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.host = host
        self.port = port
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.served_model_name = served_model_name
        self.api_key = secrets.token_urlsafe(32)
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self._lifeline: int | None = None  # write end of the pipe the guard's watchdog reads

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "VllmServer":
        try:
            self.start()
            self.wait_healthy()
        except BaseException as exc:
            self.stop(INTERRUPTED_GRACE_S if isinstance(exc, KeyboardInterrupt) else None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(INTERRUPTED_GRACE_S if exc_type is KeyboardInterrupt else None)

    def start(self) -> None:
        """Launch the server in its own session through guard.py, output appended to the log file."""
        if shutil.which(self.argv[0]) is None:
            raise EngineError(f"cannot start vLLM ({self.argv[0]}): no such executable", self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env[API_KEY_ENV] = self.api_key
        read_end, self._lifeline = os.pipe()  # both non-inheritable: only the guard gets the read end
        try:
            with open_append(self.log_path, binary=True) as log:  # a link planted at the log is refused
                self.proc = subprocess.Popen(
                    [sys.executable, "-I", str(GUARD), str(read_end), "--", *self.argv],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    pass_fds=(read_end,),
                    start_new_session=True,  # own process group: signals reach the engine core too
                )
        except OSError as exc:
            self._close_lifeline()
            raise EngineError(f"cannot start vLLM ({self.argv[0]}): {exc}", self.log_path) from exc
        finally:
            os.close(read_end)
        self.pgid = self.proc.pid

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self, timeout: float = 2.0) -> bool:
        return answers_health(self.base_url, timeout)

    def wait_healthy(self) -> None:
        """Poll /health until it answers 200 and the answer is this server's; the process exiting, another
        process answering, or the deadline passing is an EngineError."""
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if not self.alive():
                raise self.failure(f"vLLM server exited during start ({exit_description(self.proc.returncode)})")
            if self.health():
                impostor = self.not_ours()
                if impostor:
                    raise self.failure(f"port {self.port} answers /health, but {impostor}")
                return
            if time.monotonic() >= deadline:
                raise self.failure(f"vLLM server not healthy within {self.startup_timeout_s:.0f} s")
            time.sleep(0.5)

    def not_ours(self) -> str | None:
        """Why what answers on our port is not the server we started (None when it is).

        /health needs no key, so anything can answer it. The listening socket must belong to a process of our
        group (where /proc shows sockets), and /v1/models must accept our key and serve our model name.
        """
        sockets = {inode for addr, inode in port_listeners(self.port)}
        if sockets and not holds_socket(group_members(self.pgid), sockets):
            return "the socket listening there belongs to a process outside the server's group"
        req = urllib.request.Request(self.base_url + "/v1/models", headers={"Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=5.0) as resp:
                body = load_reply(resp.read(MAX_MODELS_REPLY_BYTES + 1)[:MAX_MODELS_REPLY_BYTES], "/v1/models")
        except urllib.error.HTTPError as exc:
            return f"/v1/models refuses this server's API key (HTTP {exc.code})"
        except (urllib.error.URLError, OSError, QualError) as exc:
            return f"/v1/models gives no model list ({exc})"
        names = [m.get("id") for m in body.get("data", [])] if isinstance(body, dict) else []
        if self.served_model_name is not None and self.served_model_name not in names:
            return f"/v1/models serves {names[:5]}, not {self.served_model_name!r}"
        return None

    def failure(self, what: str) -> EngineError:
        """An EngineError naming what happened and the root cause found in the log.

        The log is read before the server is stopped: the group's survivors answer our stop signals with
        tracebacks of their own (a KeyboardInterrupt), which are not why the server failed.
        """
        cause = classify_failure(self.log_text())
        self.stop()
        detail = f"{what}: {cause.kind}: {cause.line}" if cause else what
        return EngineError(detail, self.log_path)

    def log_text(self) -> str:
        try:
            return read_tail(self.log_path, MAX_LOG_BYTES)  # the failure's cause is near the end
        except (OSError, QualError):
            return ""

    def stop(self, grace_s: tuple[float, float, float] | None = None) -> None:
        """SIGINT, then SIGTERM, then SIGKILL to the whole group (a zero grace skips that signal); EngineError
        if anything survives."""
        if self.proc is None or self.pgid is None:
            self._close_lifeline()
            return
        for sig, grace in zip((signal.SIGINT, signal.SIGTERM, signal.SIGKILL), grace_s or STOP_GRACE_S):
            if not group_members(self.pgid) and self.proc.poll() is not None:
                break
            if grace <= 0:
                continue
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader so it stops counting
                if not group_members(self.pgid):
                    break
                time.sleep(0.1)
        self.proc.poll()
        left = group_members(self.pgid)
        self._close_lifeline()  # the watchdog SIGKILLs whatever is left, itself included
        pgid, self.proc, self.pgid = self.pgid, None, None
        if left:
            raise EngineError(f"vLLM processes left behind in group {pgid}: {left}", self.log_path)
