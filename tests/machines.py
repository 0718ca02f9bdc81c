"""Machines described in a test (qual.inventory.Inventory): GPUs, a vLLM build and a Hugging Face cache that this
CPU machine does not have, for the refusals and plans of runs that need them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qual.inventory import GIB, Gpu, VllmBuild

H100 = Gpu("NVIDIA H100 80GB HBM3", 80 * 10**9)  # 74.5 GiB, as torch reports the card
H200 = Gpu("NVIDIA H200", 141 * GIB)
VLLM_GPU = VllmBuild(where="/opt/venv/lib/python3.12/site-packages/vllm", distribution="vllm", version="0.33.0",
                     dflash="yes", dcp="yes")


@dataclass
class Machine:
    """An Inventory whose answers the test chose; `asked` records the questions, in order."""

    gpu_list: list[Gpu] = field(default_factory=list)
    vllm_build: VllmBuild | None = None
    hub: dict[str, Path] = field(default_factory=dict)  # repo id -> its folder, as if in the Hugging Face cache
    asked: list[str] = field(default_factory=list)

    def gpus(self) -> list[Gpu]:
        self.asked.append("gpus")
        return list(self.gpu_list)

    def vllm(self, python: str | None) -> VllmBuild | None:
        self.asked.append(f"vllm {python}")
        return self.vllm_build

    def hub_snapshot(self, repo_id: str, revision: str | None) -> Path | None:
        self.asked.append(f"hub {repo_id}@{revision}")
        return self.hub.get(repo_id)


NO_GPUS = Machine()
