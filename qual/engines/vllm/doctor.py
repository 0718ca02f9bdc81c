"""What `qual doctor` says about vLLM installs: version, launcher, DFlash, draft-KV replication, qual's patch."""

from __future__ import annotations

from pathlib import Path

from qual.engines.vllm.argv import PER_REQUEST_FLAG
from qual.engines.vllm.install import (DEFAULT_VENV, PATCH_DIR, REPO_ROOT, UNPATCHED_VENV, Evidence, QualPatch,
                                       VllmInstall, current_interpreter, from_python, locate, qual_patches)
from qual.records import DoctorCheck


def _install_checks(label: str, install: VllmInstall, patches: list[QualPatch]) -> list[DoctorCheck]:
    checks = [DoctorCheck(f"vLLM ({label})", "yes", f"{install.dist_name or 'vllm'} {install.version or '?'} at {install.package_dir}")]
    launcher = install.launcher()
    note = ("`vllm serve`" if install.model_is_positional else
            f"`python {' '.join(launcher[1:])}` (the `vllm` script of {install.dist_name} looks up the distribution "
            "'vllm' and fails)")
    checks.append(DoctorCheck("  server launcher", "yes", note))
    flag = install.has_flag(PER_REQUEST_FLAG)
    checks.append(DoctorCheck("  per-request spec-decode metrics", "yes" if flag else "no",
                        f"{PER_REQUEST_FLAG} {'present' if flag else 'absent: acceptance per request comes from /metrics diffs'}",
                        install.grep("engine/arg_utils.py", f'"{PER_REQUEST_FLAG}"')))
    dflash = install.dflash()
    checks.append(DoctorCheck("  DFlash method", dflash.verdict, {"yes": "speculative method 'dflash' and DFlash draft models present",
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
    checks.append(DoctorCheck("  replicated draft KV under DCP", kv.verdict, detail, kv.evidence))
    if dflash.verdict == "yes":
        norm = install.dflash_context_k_norm(patches)
        checks.append(DoctorCheck("  DFlash context-key norm per layer", norm.verdict, _context_k_norm_detail(label, norm),
                            norm.evidence))
    return checks


def _context_k_norm_detail(label: str, norm: Evidence) -> str:
    if norm.verdict == "yes":
        if norm.applied:
            return f"yes (qual patch {', '.join(p.label for p in norm.applied)} applied): each draft layer's " \
                   "context keys get their own k_norm"
        return "yes: each draft layer's context keys get their own k_norm (no qual patch needed)"
    if norm.verdict == "no":
        remedy = ("kept as released by `make vllm-venv`, to measure against" if label == UNPATCHED_VENV else
                  f"`make vllm-venv` patches {DEFAULT_VENV}")
        return ("no: the k_norm CPU bug (every draft layer's context keys get layer 0's k_norm): DFlash acceptance is "
                f"lower than the drafter's own (toy pair: 31.25% vs 37.33%); {remedy}")
    return "could not tell"


def vllm_checks(repo_root: Path = REPO_ROOT) -> list[DoctorCheck]:
    """The checks of each vLLM install found (.venv-vllm, .venv-vllm-unpatched, this interpreter's), in report
    order. vLLM is inspected on disk (no import here); the DFlash context-key norm is run in each install's own
    interpreter, since a file cannot tell how a kernel computes (seconds per install)."""
    checks = []
    found = []
    here = current_interpreter()
    if here is not None:
        found.append(("this interpreter", here))
    for name in (DEFAULT_VENV, UNPATCHED_VENV):
        venv_python = repo_root / name / "bin" / "python"
        venv = from_python(venv_python) if venv_python.exists() else None
        if venv is not None and (here is None or venv.package_dir != here.package_dir):
            found.append((name, venv))
    if not found:
        checks.append(DoctorCheck("vLLM", "no", f"not installed here nor in {DEFAULT_VENV}: run `make vllm-venv`"))
    patches = qual_patches(repo_root / PATCH_DIR.name)
    used = locate(None, repo_root)  # the install a run starts (a profile's vllm.python aside): the others are kept
    for label, install in found:  # beside it (the unpatched copy, to measure against), not needed by a run
        for check in _install_checks(label, install, patches):
            check.install = label
            check.needed = used is not None and install.package_dir == used.package_dir
            checks.append(check)
    return checks
