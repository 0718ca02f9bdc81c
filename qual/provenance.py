"""Facts about where qual runs: its version and git commit, this machine (torch, CUDA, GPUs, CPU), file hashes.

The harness puts them into each arm's result.json provenance (qual.harness.build); engines that run on this machine
use local_host() for their own host facts.
"""

from __future__ import annotations

import hashlib
import platform
import socket
import subprocess
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from qual.errors import QualError
from qual.paths import source_checkout
from qual.records import HostFacts
from qual.userfiles import read_chunks, read_text

MAX_PROC_BYTES = 1 << 24  # /proc/cpuinfo of a machine with hundreds of cores


def file_sha256(path: str | Path) -> str | None:
    """"sha256:<hex>" of a file's bytes (None where it cannot be read)."""
    h = hashlib.sha256()
    try:
        for chunk in read_chunks(path):
            h.update(chunk)
    except (OSError, QualError):  # missing, or no regular file (a FIFO is not waited on)
        return None
    return "sha256:" + h.hexdigest()


def _git(checkout: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@lru_cache(maxsize=1)
def qual_commit() -> tuple[str | None, bool | None]:
    """(HEAD commit, whether tracked files differ from it) of the checkout qual runs from; (None, None) for a wheel."""
    checkout = source_checkout()
    if checkout is None or not (checkout / ".git").exists():
        return None, None
    head = _git(checkout, "rev-parse", "HEAD")
    status = _git(checkout, "status", "--porcelain", "--untracked-files=no")
    return head, (bool(status) if status is not None else None)


def _cpu_model() -> str | None:
    try:
        for line in read_text("/proc/cpuinfo", MAX_PROC_BYTES, "CPU table").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, QualError):
        pass
    return platform.processor() or None


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def local_host() -> HostFacts:
    """This machine as this process sees it (a fresh copy: callers may amend it)."""
    facts = _local_host()
    return replace(facts, gpus=list(facts.gpus))


@lru_cache(maxsize=1)
def _local_host() -> HostFacts:
    facts = HostFacts(hostname=socket.gethostname(), platform=platform.platform(), python=platform.python_version(),
                      cpu_model=_cpu_model())
    try:
        import torch
    except Exception:  # noqa: BLE001 - no usable torch: the facts say so by leaving it None
        return facts
    facts.torch = torch.__version__
    facts.cuda = torch.version.cuda
    if torch.cuda.is_available():
        facts.gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts.gpu_driver = _nvidia_driver()
    return facts
