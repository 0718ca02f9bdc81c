"""`qual doctor`: what this machine can run — Python, torch and GPUs, the runtime's kernel backends, vLLM and its
DFlash/DCP support — and, for one run (`--model M [--engine E]`, else the default run), what it lacks for that run:
GPUs by count and memory (the engine's memory plan), a vLLM build, weights in the Hugging Face cache.

It exits 0 whatever it finds; with --strict it exits 1 when a check the run needs says no (✗), so that a CI job can
stop on a machine that cannot run what it is for (an unknown, ?, does not fail it; nor does a check the run does not
need, shown with –)."""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict
from typing import Optional

import typer

from qual import paths
from qual.cli.main import EXIT_GATE_FAILED, app
from qual.engines.registry import ENGINES, engine_class, get_engine
from qual.options import DEFAULT_ENGINE
from qual.records import DoctorCheck

MARK = {"yes": "✓", "no": "✗", "unknown": "?"}
# `qual doctor --json` prints a bare list of checks (its first form, which scripts read); the list cannot carry its
# schema's name, so the JSON Schema that `qual schema --doctor` prints carries it
DOCTOR_SCHEMA = "qual.doctor/1"


def doctor_schema() -> dict:
    """The JSON Schema (draft 2020-12) of `qual doctor --json`: a list of checks, generated from DoctorCheck."""
    from pydantic import TypeAdapter

    from qual.validation import schema_document, tidy_schema

    schema = TypeAdapter(list[DoctorCheck]).json_schema(ref_template="#/$defs/{model}")
    return schema_document(f"qual doctor --json ({DOCTOR_SCHEMA})", tidy_schema(schema, ("title",)), DOCTOR_SCHEMA)


def _python() -> DoctorCheck:
    ok = sys.version_info >= (3, 11)
    return DoctorCheck("Python", "yes" if ok else "no", f"{platform.python_version()} ({sys.executable})"
                 + ("" if ok else "; qual needs >= 3.11"))


def _torch(gpus_needed: bool) -> list[DoctorCheck]:
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
                                  "the embedded runtime and vLLM DCP1 run on CPU", needed=gpus_needed))
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


def _memory(plan, profile) -> DoctorCheck:
    """The memory each GPU of the run needs: the engine's memory plan for the target (reached through the engine, as a
    run reaches it; its evidence a rank's bytes by part), else the profile's gpu_memory_gib."""
    from qual.inventory import gib

    engine = get_engine(plan.engine, plan.inventory)
    planned = [need for arm in plan.arms.values() if (need := engine.memory_need(arm)) is not None]
    if planned:
        need = max(planned, key=lambda n: n.bytes)
        return DoctorCheck("  memory a GPU", "yes", f"{gib(need.bytes)}: {need.how}",
                           [f"{part}: {gib(n)}" for part, n in need.parts])
    if profile.gpu_memory_gib is not None:
        return DoctorCheck("  memory a GPU", "yes", f"{profile.gpu_memory_gib:g} GiB: the profile's gpu_memory_gib (the "
                           f"{plan.engine} engine has no memory plan for this target here)")
    return DoctorCheck("  memory a GPU", "unknown", f"the {plan.engine} engine has no memory plan for this target "
                       "here, and the profile gives no gpu_memory_gib")


def _run_checks(plan, model_given: bool) -> list[DoctorCheck]:
    """What the run lacks on this machine (the refusals `qual run` would answer with), and the memory it needs."""
    from qual.profiles import load_profile

    profile = load_profile(plan.options.model)
    control, candidate = plan.arms["control"], plan.arms["candidate"]
    command = f"qual run --model {plan.options.model}" if model_given else "qual run (the default run)"
    checks = [DoctorCheck("run", "no" if plan.lacking else "yes",
                          f"{command}: {plan.how}; control DCP {control.dcp}, candidate DCP {candidate.dcp}, "
                          f"TP {candidate.tp}" + (f"; {len(plan.lacking)} thing(s) missing" if plan.lacking else ""))]
    for problem in plan.lacking:
        subject, _, detail = problem.partition(": ")
        checks.append(DoctorCheck(f"  {subject}", "no", detail))
    if any(arm.device.startswith("cuda") for arm in plan.arms.values()):
        checks.append(_memory(plan, profile))
    return checks


def collect_checks(plan=None, model_given: bool = False) -> list[DoctorCheck]:
    """Every check, in report order: this Python and torch, the profiles, gates and corpora found, then what each
    engine says about itself (the reference engine: its runtime's kernel backends), then what `plan` (a dry-run
    RunPlan of the run asked about) lacks here. A check of an engine the run does not use is not needed."""
    cuda = plan is not None and any(arm.device.startswith("cuda") for arm in plan.arms.values())
    checks = [_python(), *_torch(cuda), *_kept_files()]
    for name in ENGINES:
        for check in engine_class(name).doctor():
            check.needed = check.needed and (plan is None or name == plan.engine)
            checks.append(check)
    return checks + (_run_checks(plan, model_given) if plan is not None else [])


def _names(checks: list[DoctorCheck]) -> list[str]:
    """Each check's name, one for each: a part (indented under the check before it) is named with that check's
    ('run: GPUs', beside the machine's own GPUs check)."""
    names, parent = [], ""
    for c in checks:
        part = c.name != c.name.lstrip()
        parent = parent if part else c.name
        names.append(f"{parent}: {c.name.strip()}" if part and parent else c.name.strip())
    return names


def _mark(check: DoctorCheck) -> str:
    return MARK[check.verdict] if check.needed or check.verdict == "yes" else "–"


@app.command()
def doctor(
    model: Optional[str] = typer.Option(None, "--model", metavar="NAME", help="Check what `qual run --model NAME` "
                                        "needs here (default: the default run, the toy profile)."),
    engine: Optional[str] = typer.Option(None, "--engine", metavar="|".join(ENGINES), help=f"With that engine "
                                         f"(default: the profile's, else {DEFAULT_ENGINE})."),
    as_json: bool = typer.Option(False, "--json", help=f"Print the checks as JSON: a list of checks (name, verdict, "
                                 f"detail, evidence, install, needed; `qual schema --doctor`, {DOCTOR_SCHEMA})."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show the evidence behind each verdict."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when a check the run needs says no (✗); without it, "
                                "exit 0."),
) -> None:
    """Check Python, torch, GPUs, the runtime's backends and each vLLM install (version, DFlash, replicated draft KV
    under DCP, qual's patch), and what a run lacks on this machine: GPUs and their memory, vLLM, weights."""
    from qual.harness.plan import make_plan, run_options

    plan = make_plan(run_options(model=model or "toy", engine=engine), dry_run=True)
    checks = collect_checks(plan, model is not None)
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            unused = _mark(c) == "–"
            print(f"{_mark(c)} {c.name.ljust(width)}  {c.detail}" + ("  (not needed by this run)" if unused else ""))
            if verbose or c.verdict != "yes":
                for line in c.evidence:
                    print(f"  {' ' * width}    {line}")
    failed = [name for c, name in zip(checks, _names(checks)) if c.verdict == "no" and c.needed]
    if strict and failed:
        print(f"doctor --strict: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        raise typer.Exit(EXIT_GATE_FAILED)
