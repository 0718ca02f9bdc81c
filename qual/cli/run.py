"""`qual run`: control (DCP 1) vs candidate (DCP N) on the same corpus, gated."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from qual.cli.crash import crash_report
from qual.cli.main import EXIT_GATE_FAILED, app
from qual.cli.outputs import history_file, output_dir
from qual.cli.verdict import print_verdict
from qual.engines.registry import get_engine
from qual.errors import QualError


@app.command("run")
def run_command(
    model: str = typer.Option("toy", "--model", help="Model profile: a shipped name (qual/data/configs/models) or a YAML path."),
    dcp: Optional[int] = typer.Option(None, "--dcp", help="Candidate DCP size (default: the profile's, else 4); the control is DCP 1."),
    tp: Optional[int] = typer.Option(None, "--tp", help="TP size of both arms (default: the profile's, else --dcp)."),
    engine: str = typer.Option("reference", "--engine", help="reference | vllm"),
    corpus: Optional[str] = typer.Option(None, "--corpus", help="Corpus name or JSONL path (default: the profile's)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Replay only the first K requests."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Max new tokens per request."),
    draft_kv: Optional[str] = typer.Option(None, "--draft-kv", help="replicated (the fix; default) | sharded (legacy)."),
    temperature: float = typer.Option(0.0, "--temperature"),
    seed: int = typer.Option(0, "--seed"),
    gate: Optional[str] = typer.Option(None, "--gate", help="Gate rules YAML (default: the shipped nightly.yaml)."),
    out: Optional[str] = typer.Option(None, "--out", help="Output directory (default ./reports/<time>-<model>-dcp<N>/)."),
    history: Optional[str] = typer.Option(None, "--history", help="History database (default ./reports/history.sqlite)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu (default) | cuda."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Override the profile's dtype."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print both arms and change nothing."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Finish an interrupted run in DIR."),
) -> None:
    """Replay one corpus through control and candidate, compare acceptance, apply the gate."""
    from qual.harness.plan import RunOptions, load_plan_options, make_plan

    if resume is not None:
        options = load_plan_options(resume)
        saved = json.loads((resume / "run.json").read_text())
        plan = make_plan(options)
        plan.out_dir = resume
        if plan.corpus_info["fingerprint"] != saved["corpus"]["fingerprint"]:
            raise QualError(f"--resume {resume}: the corpus changed since the run started (fingerprint differs)")
    else:
        options = RunOptions(model=model, dcp=dcp, tp=tp, engine=engine, corpus=corpus, limit=limit, max_tokens=max_tokens,
                             draft_kv=draft_kv, temperature=temperature, seed=seed, gate=gate, out=out, history=history,
                             device=device, dtype=dtype)
        plan = make_plan(options, dry_run=dry_run)
    if dry_run:
        _print_dry_run(plan)
        return
    if resume is None and plan.out_dir.is_dir() and any(plan.out_dir.iterdir()):
        raise QualError(f"--out {plan.out_dir} is not empty (use --resume to finish a run there)")
    history_file(plan.history_path)
    output_dir(plan.out_dir, "--out")
    try:
        with crash_report(plan.out_dir):  # from here on a bug's traceback goes to <out>/crash.txt
            result = _run_with_progress(plan)
            print_verdict(result, "control", "candidate", plan.out_dir)
    except KeyboardInterrupt:
        print(f"finish the run with: qual run --resume {plan.out_dir}", file=sys.stderr)
        raise
    if not result.gate.passed:
        raise typer.Exit(EXIT_GATE_FAILED)


def _print_dry_run(plan) -> None:
    print(f"# dry run: nothing is started or written (out would be {plan.out_dir})")
    print(f"# corpus {plan.corpus_info['name']}: {plan.corpus_info['count']} requests, {plan.corpus_info['fingerprint']}")
    engine = get_engine(plan.options.engine)
    for arm, config in plan.arms.items():
        print(f"{arm}: {engine.describe(config)}")


def _run_with_progress(plan):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from qual.harness.execute import execute

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=False, disable=not sys.stderr.isatty()) as bar:
        tasks = {}

        def progress(arm: str, finished: int, total: int) -> None:
            if arm not in tasks:
                c = plan.arms[arm]
                tasks[arm] = bar.add_task(f"{arm} (dcp {c.dcp}, tp {c.tp})", total=total)
            bar.update(tasks[arm], completed=finished)

        result, _ = execute(plan, progress)
    return result
