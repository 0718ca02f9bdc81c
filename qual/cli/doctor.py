"""`qual doctor`: what this machine can run — Python, torch and GPUs, the runtime's kernel backends, vLLM and its
DFlash/DCP support.

It exits 0 whatever it finds; with --strict it exits 1 when a check says no (✗), so that a CI job can stop on a
machine that cannot run what it is for (an unknown, ?, does not fail it)."""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict

import typer

from qual import paths
from qual.cli.main import EXIT_GATE_FAILED, app
from qual.engines.registry import ENGINES, engine_class
from qual.records import DoctorCheck

MARK = {"yes": "✓", "no": "✗", "unknown": "?"}


def _python() -> DoctorCheck:
    ok = sys.version_info >= (3, 11)
    return DoctorCheck("Python", "yes" if ok else "no", f"{platform.python_version()} ({sys.executable})"
                 + ("" if ok else "; qual needs >= 3.11"))


def _torch() -> list[DoctorCheck]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable torch"
        return [DoctorCheck("torch", "no", f"not importable: {exc}")]
    checks = [DoctorCheck("torch", "yes", torch.__version__)]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        checks.append(DoctorCheck("GPUs", "yes", f"{len(names)} CUDA device(s), CUDA {torch.version.cuda}", names))
    else:
        checks.append(DoctorCheck("GPUs", "no", "no CUDA device: vLLM DCP>1 and CUDA graphs need GPUs; "
                                           "the embedded runtime and vLLM DCP1 run on CPU"))
    return checks


def _kept_files() -> list[DoctorCheck]:
    """The profiles, gates and corpora found by name, and the folders searched ($QUAL_ROOT, the checkout, the
    package), each name with the place it comes from."""
    checks = []
    for kind, title in (("profile", "profiles"), ("gate", "gates"), ("corpus", "corpora")):
        found = paths.available(kind)
        names = ", ".join(f"{name} ({where.origin})" for name, where in found.items())
        checks.append(DoctorCheck(title, "yes" if found else "no", names or "none found",
                                  [f"searched {place.describe()}" for place in paths.places(kind)]))
    return checks


def collect_checks() -> list[DoctorCheck]:
    """Every check, in report order: this Python and torch, the profiles, gates and corpora found, then what each
    engine says about itself (the reference engine: its runtime's kernel backends)."""
    checks = [_python(), *_torch(), *_kept_files()]
    for name in ENGINES:
        checks += engine_class(name).doctor()
    return checks


@app.command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show the evidence behind each verdict."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when any check says no (✗); without it, exit 0."),
) -> None:
    """Check Python, torch, GPUs, the runtime's backends and each vLLM install (version, DFlash, replicated draft KV
    under DCP, qual's patch)."""
    checks = collect_checks()
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{MARK[c.verdict]} {c.name.ljust(width)}  {c.detail}")
            if verbose or c.verdict != "yes":
                for line in c.evidence:
                    print(f"  {' ' * width}    {line}")
    failed = [c.name for c in checks if c.verdict == "no"]
    if strict and failed:
        print(f"doctor --strict: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        raise typer.Exit(EXIT_GATE_FAILED)
