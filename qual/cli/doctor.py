"""`qual doctor`: what this machine can run — Python, torch and GPUs, vLLM and its DFlash/DCP support."""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import typer

from qual.cli.main import app
from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT, VllmInstall, current_interpreter, from_python
from qual.engines.vllm.argv import PER_REQUEST_FLAG

MARK = {"yes": "✓", "no": "✗", "unknown": "?"}


@dataclass
class Check:
    """One line of the doctor's report: a verdict (yes/no/unknown) with what it rests on."""

    name: str
    verdict: str
    detail: str
    evidence: list[str] = field(default_factory=list)


def _python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check("Python", "yes" if ok else "no", f"{platform.python_version()} ({sys.executable})"
                 + ("" if ok else "; qual needs >= 3.11"))


def _torch() -> list[Check]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable torch"
        return [Check("torch", "no", f"not importable: {exc}")]
    checks = [Check("torch", "yes", torch.__version__)]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        checks.append(Check("GPUs", "yes", f"{len(names)} CUDA device(s), CUDA {torch.version.cuda}", names))
    else:
        checks.append(Check("GPUs", "no", "no CUDA device: vLLM DCP>1 and CUDA graphs need GPUs; "
                                           "the embedded runtime and vLLM DCP1 run on CPU"))
    return checks


def _install_checks(label: str, install: VllmInstall) -> list[Check]:
    checks = [Check(f"vLLM ({label})", "yes", f"{install.dist_name or 'vllm'} {install.version or '?'} at {install.package_dir}")]
    launcher = install.launcher()
    note = ("`vllm serve`" if install.model_is_positional else
            f"`python {' '.join(launcher[1:])}` (the `vllm` script of {install.dist_name} looks up the distribution "
            "'vllm' and fails)")
    checks.append(Check(f"  server launcher", "yes", note))
    flag = install.has_flag(PER_REQUEST_FLAG)
    checks.append(Check(f"  per-request spec-decode metrics", "yes" if flag else "no",
                        f"{PER_REQUEST_FLAG} {'present' if flag else 'absent: acceptance per request comes from /metrics diffs'}",
                        install.grep("engine/arg_utils.py", f'"{PER_REQUEST_FLAG}"')))
    dflash = install.dflash()
    checks.append(Check("  DFlash method", dflash.verdict, {"yes": "speculative method 'dflash' and DFlash draft models present",
                                                           "no": "no DFlash support in this build",
                                                           "unknown": "could not tell"}[dflash.verdict], dflash.evidence))
    kv = install.replicated_draft_kv()
    detail = {
        "yes": "draft KV stays unsharded (DCP1 geometry) while target KV is DCP-sharded",
        "no": "draft KV would follow the target's DCP sharding (the sharded draft-KV acceptance bug, docs/dflash.md)",
        "unknown": "mechanism only partly present",
    }[kv.verdict]
    if kv.verdict == "yes" and any("Model Runner V1" in line for line in kv.evidence):
        detail += " — in Model Runner V2 only; the V1 runner has no such override"
    checks.append(Check("  replicated draft KV under DCP", kv.verdict, detail, kv.evidence))
    if dflash.verdict == "yes":
        norm = install.grouped_rms_norm()
        checks.append(Check("  DFlash context-key norm per layer", norm.verdict, {
            "yes": "each draft layer's context keys get their own k_norm",
            "no": "every draft layer's context keys get layer 0's k_norm (a vLLM bug): DFlash acceptance is lower "
                  "than the drafter's own (toy pair: 31.25% vs 37.33%)",
            "unknown": "could not tell"}[norm.verdict], norm.evidence))
    return checks


def collect_checks(repo_root: Path = REPO_ROOT) -> list[Check]:
    """Every check, in report order. vLLM is inspected on disk (no import here); one op is run in its own
    interpreter where a file cannot tell (a few seconds)."""
    checks = [_python(), *_torch()]
    found = []
    here = current_interpreter()
    if here is not None:
        found.append(("this interpreter", here))
    venv_python = repo_root / DEFAULT_VENV / "bin" / "python"
    venv = from_python(venv_python) if venv_python.exists() else None
    if venv is not None and (here is None or venv.package_dir != here.package_dir):
        found.append((DEFAULT_VENV, venv))
    if not found:
        checks.append(Check("vLLM", "no", f"not installed here nor in {DEFAULT_VENV}: run `make vllm-venv`"))
    for label, install in found:
        checks.extend(_install_checks(label, install))
    return checks


@app.command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show the evidence behind each verdict."),
) -> None:
    """Check Python, torch, GPUs and vLLM (version, DFlash, replicated draft KV under DCP)."""
    checks = collect_checks()
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
        return
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{MARK[c.verdict]} {c.name.ljust(width)}  {c.detail}")
        if verbose or c.verdict != "yes":
            for line in c.evidence:
                print(f"  {' ' * width}    {line}")
