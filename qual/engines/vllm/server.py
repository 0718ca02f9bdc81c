"""Run `vllm serve` as a child process group: start, wait for /health, stop without leftovers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from qual.errors import EngineError
from qual.engines.vllm.logparse import classify_failure

# Seconds to wait after each signal before escalating (SIGINT lets uvicorn and the engine core shut down).
STOP_GRACE_S = (10.0, 5.0, 5.0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on host (the server binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group pgid, from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


class VllmServer:
    """One `vllm serve` process group; a context manager that always stops it."""

    def __init__(
        self,
        argv: list[str],
        log_path: Path,
        port: int,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 600.0,
    ):
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.host = host
        self.port = port
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "VllmServer":
        try:
            self.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the server in its own session, output appended to the log file."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,  # own process group: signals reach the engine core too
                )
            except OSError as exc:
                raise EngineError(f"cannot start vLLM ({self.argv[0]}): {exc}", self.log_path) from exc
        self.pgid = self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self) -> None:
        """Poll /health until it answers 200; the process exiting or the deadline passing is an EngineError."""
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if not self.alive():
                raise self.failure(f"vLLM server exited during start (exit code {self.proc.returncode})")
            if self.health():
                return
            if time.monotonic() >= deadline:
                raise self.failure(f"vLLM server not healthy within {self.startup_timeout_s:.0f} s")
            time.sleep(0.5)

    def failure(self, what: str) -> EngineError:
        """An EngineError naming what happened and the root cause found in the log."""
        self.stop()
        cause = classify_failure(self.log_text())
        detail = f"{what}: {cause.kind}: {cause.line}" if cause else what
        return EngineError(detail, self.log_path)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGINT, then SIGTERM, then SIGKILL to the whole group; EngineError if anything survives."""
        if self.proc is None or self.pgid is None:
            return
        for sig, grace in zip((signal.SIGINT, signal.SIGTERM, signal.SIGKILL), STOP_GRACE_S):
            if not group_members(self.pgid) and self.proc.poll() is not None:
                break
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
        pgid, self.proc, self.pgid = self.pgid, None, None
        if left:
            raise EngineError(f"vLLM processes left behind in group {pgid}: {left}", self.log_path)
