"""ThisMachine: the Inventory (qual/inventory.py) of the machine qual runs on, each answer found when first asked."""

from __future__ import annotations

from pathlib import Path

from qual.inventory import Gpu, VllmBuild


class ThisMachine:
    """This machine's GPUs (torch, as the runtime and vLLM see them), its vLLM installs (read from their files, as
    `qual doctor` reads them) and its Hugging Face cache (huggingface_hub, offline)."""

    def __init__(self) -> None:
        self._gpus: list[Gpu] | None = None  # found once (every arm asks)

    def gpus(self) -> list[Gpu]:
        if self._gpus is None:
            self._gpus = self._find_gpus()
        return list(self._gpus)

    @staticmethod
    def _find_gpus() -> list[Gpu]:
        from qual.proc import signals_held
        from qual.stop_signals import STOP_SIGNALS

        try:
            with signals_held(set(STOP_SIGNALS)):  # torch's import must not meet a KeyboardInterrupt (qual.proc)
                import torch
            if not torch.cuda.is_available():
                return []
            return [Gpu(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
                    for i in range(torch.cuda.device_count())]
        except (ImportError, OSError, RuntimeError):  # no torch, or a driver that fails: no GPU this run can use
            return []

    def vllm(self, python: str | None) -> VllmBuild | None:
        from qual.engines.vllm.install import locate

        install = locate(python)
        if install is None or install.package_dir is None:
            return None
        return VllmBuild(where=str(install.package_dir), distribution=install.dist_name, version=install.version,
                         dflash=install.dflash().verdict,
                         dcp="yes" if install.has_flag("--decode-context-parallel-size") else "no")

    def hub_snapshot(self, repo_id: str, revision: str | None) -> Path | None:
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            return None
        try:
            return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
        except (OSError, ValueError):  # not in the cache (LocalEntryNotFoundError), or no repository id at all
            return None
