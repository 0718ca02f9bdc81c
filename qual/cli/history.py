"""`qual history list | show | trend | publish`: read the run history database."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qual import history as hist
from qual.errors import QualError
from qual.nights import check_axis
from qual.options import DRAFT_KV_MODES
from qual.paths import DEFAULT_HISTORY
from qual.shown import safe
from qual.cli.main import EXIT_GATE_FAILED, app


history_app = typer.Typer(no_args_is_help=True, help="Run history: list, show, trend and publish recorded runs.")
app.add_typer(history_app, name="history")

HistoryOpt = typer.Option(DEFAULT_HISTORY, "--history", help="History database (SQLite).")
StepOpt = typer.Option(hist.DEFAULT_STEP_PP, "--threshold-pp", metavar="PP",
                       help="A step change is a jump of more than PP percentage points in either arm's acceptance "
                       "between consecutive runs of a configuration (a finite number >= 0).")


def _console() -> Console:
    # Pipes and CI logs have no width; 80 columns would fold every row.
    console = Console()
    return console if console.is_terminal else Console(width=200)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.2f}%"


def _pp(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.2f}"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _t(value: object) -> str:
    """User text (model names, paths, series labels) printed literally: "[/]" in a model name is not markup, and a
    control character (a terminal's escape sequence) is shown as its escape."""
    return escape(safe(value))


def _model_name(model: str | None) -> str | None:
    """--model as recorded: a profile name, or a profile file given as `qual run --model` takes it (its name)."""
    if model is None or not model.endswith((".yaml", ".yml")) or not Path(model).is_file():
        return model
    from qual.profiles import load_profile

    return load_profile(model).name


def _none_found(history: Path, filters: dict[str, object]) -> str:
    """Why a listing is empty: the history holds no run, or none of its runs matches the filters given."""
    given = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in filters.items() if value is not None)
    total = hist.count_runs(history) if given else 0
    if not total:
        return f"no runs recorded in {_t(history)}"
    return f"no run matches {_t(given)} in {_t(history)} ({total} run{'s' if total != 1 else ''} recorded)"


def _verdict(run: hist.HistoryRun) -> str:
    """pass, FAIL, INCONCLUSIVE (and how it exited), or ERROR with its exit code."""
    if run.outcome == hist.PASS:
        return "[green]pass[/]"
    if run.outcome == hist.INCONCLUSIVE:
        return f"[yellow]INCONCLUSIVE[/] (exit {0 if run.verdict == hist.PASS else 1})"
    if run.outcome == hist.ERROR:
        return f"[bold red]ERROR[/] (exit {run.exit_code})"
    return "[bold red]FAIL[/]"


# The JSON documents the history commands print (--json): each names its schema, as result.json does
LIST_SCHEMA, RUN_SCHEMA, TREND_SCHEMA, PRUNE_SCHEMA = ("qual.history.list/1", "qual.history.run/1",
                                                       "qual.history.trend/1", "qual.history.prune/1")


def run_json(r: hist.HistoryRun) -> dict:
    """One night as the JSON outputs give it: every column but the stored config, read typed."""
    return {"id": r.id, "run_id": r.run_id, "created_at": r.created_at, "outcome": r.outcome, "verdict": r.verdict,
            "exit_code": r.exit_code, "error": r.error, "model": r.model, "engine": r.engine,
            "engine_version": r.engine_version, "qual_commit": r.qual_commit, "dcp": r.dcp, "tp": r.tp,
            "draft_kv": r.draft_kv, "corpus_name": r.corpus_name, "corpus_fingerprint": r.corpus_fingerprint,
            "n_requests": r.n_requests, "control_rate": r.control_rate, "candidate_rate": r.candidate_rate,
            "control_mean_acceptance_length": r.control_mal, "candidate_mean_acceptance_length": r.candidate_mal,
            "delta_rate": r.delta_rate, "delta_rate_ci95": None if r.ci_lo is None else [r.ci_lo, r.ci_hi],
            "failed_checks": r.failed_checks, "baseline": r.baseline, "result_path": r.result_path,
            "run_dir": r.run_dir, "command": r.command, "series": r.series,
            "configuration": asdict(r.key) if r.key is not None else None, "meta": r.meta, "facts": r.facts}


def _print_json(data: dict) -> None:
    print(json.dumps(data, indent=2))


@history_app.command("list")
def list_cmd(
    history: Path = HistoryOpt,
    model: Optional[str] = typer.Option(None, "--model", help="Only this model (a profile name, or its file)."),
    limit: int = typer.Option(20, "--limit", min=1, help="Newest N runs."),
    as_json: bool = typer.Option(False, "--json", help=f"Print the runs as JSON ({LIST_SCHEMA})."),
) -> None:
    """Recorded runs, newest first."""
    runs = hist.list_runs(history, model=_model_name(model), limit=limit)
    if as_json:
        _print_json({"schema": LIST_SCHEMA, "history": str(history), "runs": [run_json(r) for r in runs]})
        return
    console = _console()
    if not runs:
        console.print(_none_found(history, {"model": model}), highlight=False, soft_wrap=True)
        return
    table = Table(title=f"qual runs ({_t(history)})", box=box.SIMPLE_HEAD)
    for col, justify in (("id", "right"), ("created (UTC)", "left"), ("model", "left"), ("engine", "left"),
                         ("commit", "left"), ("dcp", "right"), ("draft kv", "left"), ("requests", "right"),
                         ("control", "right"), ("candidate", "right"), ("delta pp", "right"), ("verdict", "left")):
        table.add_column(col, justify=justify)
    for r in runs:
        table.add_row(str(r.id), _t(r.created_at[:16].replace("T", " ")), _t(r.model), _t(r.engine_version or r.engine),
                      _t((r.qual_commit or "-")[:10]), str(r.dcp), _t(r.draft_kv), str(r.n_requests),
                      _pct(r.control_rate), _pct(r.candidate_rate), _pp(r.delta_rate), _verdict(r))
    console.print(table)


@history_app.command("show")
def show_cmd(run_id: int = typer.Argument(..., help="Run id from `qual history list`."), history: Path = HistoryOpt,
             as_json: bool = typer.Option(False, "--json", help=f"Print the run as JSON ({RUN_SCHEMA}).")) -> None:
    """Everything recorded about one run."""
    r = hist.get_run(history, run_id)
    if as_json:
        _print_json({"schema": RUN_SCHEMA, "history": str(history), "run": {**run_json(r), "config": r.config}})
        return
    console = _console()
    table = Table(show_header=False, title=f"run {r.id}")
    table.add_column(style="bold")
    table.add_column()
    ci = "n/a" if r.ci_lo is None else f"[{r.ci_lo * 100:+.2f}, {r.ci_hi * 100:+.2f}] pp"
    rows = [
        ("created", _t(r.created_at)), ("verdict", _verdict(r)),
        *([("cause", _t(r.error or "n/a"))] if r.is_error else []),
        ("failed checks", _t(", ".join(r.failed_checks) or "none")), ("model", _t(r.model)),
        ("engine", _t(f"{r.engine} ({r.engine_version})")), ("qual commit", _t(r.qual_commit or "n/a")),
        ("series", _t(r.series)),
        ("corpus", _t(f"{r.corpus_name} ({r.n_requests} requests) {r.corpus_fingerprint}")),
        ("control rate", _pct(r.control_rate)), ("candidate rate", _pct(r.candidate_rate)),
        ("delta", _t(f"{_pp(r.delta_rate)} pp, 95% CI {ci}")),
        ("mean acceptance length", f"{_num(r.control_mal)} -> {_num(r.candidate_mal)}"),
        ("baseline", _t(r.baseline or "none")),
        ("result", _t(r.result_path or "n/a")), ("run folder", _t(r.run_dir or "n/a")), ("run id", _t(r.run_id or "n/a")),
        ("command", _t(r.command or "n/a")),
        *((f"meta {k}", _t(v)) for k, v in r.meta.items()),
        *((name, _t(v)) for name, v in r.facts.items() if v is not None and name not in ("engine",)),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    console.print_json(json.dumps(r.config))


@history_app.command("trend")
def trend_cmd(
    history: Path = HistoryOpt,
    model: Optional[str] = typer.Option(None, "--model", help="Only this model (a profile name, or its file)."),
    dcp: Optional[int] = typer.Option(None, "--dcp", help="Only candidates of this DCP size."),
    draft_kv: Optional[str] = typer.Option(None, "--draft-kv", metavar="|".join(DRAFT_KV_MODES),
                                           help="Only this draft KV layout."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the plot here (.png or .svg)."),
    axis: str = typer.Option("date", "--axis", help="What each series is plotted along: date, engine (its version), "
                             "qual (version and commit) or meta:KEY (a `qual run --meta KEY=...`)."),
    threshold_pp: float = StepOpt,
    as_json: bool = typer.Option(False, "--json", help=f"Print the series and step changes as JSON ({TREND_SCHEMA})."),
    fail_on_step: bool = typer.Option(False, "--fail-on-step", help="Exit 1 when a step change is flagged."),
) -> None:
    """Acceptance over nights per configuration (qual.configuration), along an axis; flags step changes between
    consecutive runs and names what changed between them (engine, torch, qual)."""
    check_axis(axis)
    hist.check_step_pp(threshold_pp)
    if out is not None:  # before the work, not after the trend was printed
        _check_plot_path(out)
    series = hist.trend(history, model=_model_name(model), dcp=dcp, draft_kv=draft_kv)
    runs = [r for rows in series.values() for r in rows]
    steps = hist.detect_step_changes(runs, threshold_pp)
    if as_json:
        _print_json(_trend_json(series, steps, threshold_pp, axis))
    else:
        _print_trend(series, steps, threshold_pp, history, {"model": model, "dcp": dcp, "draft_kv": draft_kv})
    if out is not None:
        from qual.report import plots, trend

        panels = [trend.arms_panel(label, rows, [trend.column(r, axis) for r in rows],
                                   [s for s in steps if s.series == label]) for label, rows in sorted(series.items())]
        path = plots.save_figure(plots.nights_figure(panels, axis, panel_height=2.6), out)
        print(f"plot written to {safe(path)}", file=sys.stderr if as_json else sys.stdout)
    if steps and fail_on_step:
        raise typer.Exit(EXIT_GATE_FAILED)


def _check_plot_path(out: Path) -> None:
    """--out names a plot file (.png or .svg, not a folder) in a folder that exists or can be made, and written."""
    from qual.cli.outputs import output_dir
    from qual.files import check_replaceable
    from qual.report.plots import plot_format

    plot_format(out)
    if out.is_dir():
        raise QualError(f"--out {out}: is a directory; give the plot file's path")
    check_replaceable(out)  # a FIFO or a device there is refused now, not waited on after the trend is printed
    output_dir(out.parent, "--out")


def _print_trend(series: dict, steps: list, threshold_pp: float, history: Path, filters: dict[str, object]) -> None:
    console = _console()
    for label, rows in series.items():
        latest = rows[-1]
        why = f": {_t(latest.error)}" if latest.is_error else ""
        errors = sum(r.is_error for r in rows)
        gaps = f" ({errors} without a verdict)" if errors else ""
        console.print(f"{_t(label)}: {len(rows)} runs{gaps}, latest control {_pct(latest.control_rate)} "
                      f"candidate {_pct(latest.candidate_rate)} ({_verdict(latest)}{why})", highlight=False,
                      soft_wrap=True)
    if not series:
        console.print(_none_found(history, filters), highlight=False, soft_wrap=True)
    if steps:
        console.print(f"[bold red]{len(steps)} step change(s) > {threshold_pp:g} pp:[/]")
        for s in steps:
            console.print(f"  {_t(s.describe())}", highlight=False, soft_wrap=True)
    elif series:
        console.print(f"no step changes > {threshold_pp:g} pp")


def _trend_json(series: dict, steps: list, threshold_pp: float, axis: str) -> dict:
    """Each series: its configuration key (fields) and nights, oldest first, each with its place on the axis and what
    changed since the night before; the flagged steps."""
    out = []
    for label, rows in series.items():
        nights = [{**run_json(r), "x": hist.position(r, axis),
                   "changed": hist.changed(rows[i - 1], r) if i else []} for i, r in enumerate(rows)]
        out.append({"label": label, "configuration": asdict(rows[0].key) if rows[0].key is not None else None,
                    "runs": nights})
    return {
        "schema": TREND_SCHEMA,
        "axis": axis,
        "threshold_pp": threshold_pp,
        "series": out,
        "steps": [{"series": s.series, "arm": s.arm, "previous_run_id": s.previous_run_id, "run_id": s.run_id,
                   "created_at": s.created_at, "before": s.before, "after": s.after, "delta_pp": s.delta * 100,
                   "notes": s.notes} for s in steps],
    }


@history_app.command("export")
def export_cmd(
    out_dir: Path = typer.Argument(..., metavar="DIR", help="Folder for runs.<format> and series.<format>."),
    fmt: str = typer.Option("csv", "--format", metavar="csv|parquet", help="CSV (a text cell starting "
                     "=, +, -, @, tab or CR written with a leading ', so a spreadsheet shows it as text), or Parquet "
                     "(values as recorded; needs pyarrow)."),
    history: Path = HistoryOpt,
) -> None:
    """Write the history's nights (runs) and series as tables: one row a night, one a series (what
    `qual.load_history` gives a notebook)."""
    from qual.cli.outputs import check_before_work
    from qual.history.frames import FORMATS, export, load_history

    if fmt not in FORMATS:  # before the work
        raise QualError(f"--format {fmt!r}: expected {' or '.join(FORMATS)}")
    check_before_work(out_dir, history, history_written=False, out_option="DIR")
    loaded = load_history(history)
    for path in export(loaded, out_dir, fmt):
        print(f"wrote {safe(path)}")


@history_app.command("prune")
def prune_cmd(
    runs_dir: Path = typer.Argument(..., metavar="DIR", help="The folder whose subfolders are run directories "
                                    "(a CI job's reports/runs)."),
    keep: int = typer.Option(..., "--keep", min=0, help="Run directories kept besides the baselines': the newest N."),
    history: Path = HistoryOpt,
    as_json: bool = typer.Option(False, "--json", help=f"Print what was kept and removed as JSON ({PRUNE_SCHEMA})."),
) -> None:
    """Remove old run directories under DIR: keep the newest N (by name, numbers as numbers: <run id>-<attempt>) and
    every one a baseline may still read (pins, each series' last pass); folders that are not qual run directories,
    and a run directory a running qual holds, are never touched. The history keeps every row."""
    from qual.history.prune import prune

    done = prune(runs_dir, keep, history)
    if as_json:
        _print_json({"schema": PRUNE_SCHEMA, "runs_dir": str(runs_dir), **done.to_json()})
        return
    for path in done.baselines:
        print(f"kept {safe(path)} (a baseline)")
    for path, why in done.left:
        print(f"left {safe(path)} ({safe(why)})")
    print(f"removed {len(done.removed)} run director{'y' if len(done.removed) == 1 else 'ies'}, kept "
          f"{len(done.kept)} ({len(done.baselines)} for baselines)")


@history_app.command("publish")
def publish_cmd(
    out_dir: Path = typer.Argument(..., metavar="DIR", help="Folder for the site (new, empty, or an earlier publish)."),
    history: Path = HistoryOpt,
    axis: str = typer.Option("date", "--axis", help="What every plot runs along, as `qual history trend --axis`: "
                             "date, engine (its version), qual (version and commit) or meta:KEY."),
    threshold_pp: float = StepOpt,
) -> None:
    """A static site of the history: an index of configurations with an overview plot, a page per configuration
    (trends, runs), a page of step changes, and each run's report copied under DIR/runs/; offline, relative links
    only. DIR is replaced whole."""
    from qual.cli.outputs import check_before_work
    from qual.report import site as published

    check_axis(axis)
    hist.check_step_pp(threshold_pp)
    check_before_work(out_dir, history, history_written=False, create_out=False, out_option="DIR")
    result = published.publish(history, out_dir, axis, threshold_pp)
    nights = result.nights
    linked = sum(n.report is not None for n in nights)
    n_conf, n_runs = len(result.configurations), len(nights)
    print(f"published {n_conf} configuration{'s' if n_conf != 1 else ''}, {n_runs} run{'s' if n_runs != 1 else ''} "
          f"({linked} with their report) to {safe(out_dir)}/index.html")
    for n in nights:
        if n.missing:
            print(f"  run {n.run.id}: from its history row only: {safe(n.missing)}")


baseline_app = typer.Typer(
    no_args_is_help=True,
    help="Pinned baselines: `qual run --baseline history:last-pass` takes the run pinned for its configuration, "
    "else the newest passing run of it.",
)
history_app.add_typer(baseline_app, name="baseline")


@baseline_app.command("pin")
def pin_cmd(run: str = typer.Argument(..., metavar="RUN", help="A run id from `qual history list`, or the run's "
                                      "directory (its --out; a sweep's: each of its candidates)."),
            history: Path = HistoryOpt) -> None:
    """Make RUN the baseline of its configuration (it wins over the newest passing run): a night accepted as its
    series' level, failed or not. A sweep's directory pins each of its candidates, each in its own series."""
    from datetime import timezone

    runs = hist.find_night(history, run)
    for one in runs:  # every result file checked before any pin changes
        if not one.result_path or not Path(one.result_path).is_file():
            raise QualError(f"run {one.id}: its result file {one.result_path or '(none recorded)'} is missing; "
                            "a baseline is read from it")
    pinned_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for one in runs:
        one, previous = hist.pin(history, one.id, pinned_at)
        # Plain print: run fields are recorded text, never console markup.
        replaced = f" (replaces run {previous})" if previous is not None else ""
        print(f"run {one.id} is now the baseline of its configuration{replaced}: {safe(one.series)}")
        if one.outcome != hist.PASS:
            print(f"note: run {one.id} did not pass its gate ({one.outcome}: {safe(', '.join(one.failed_checks))}); "
                  "it is pinned as asked")


@baseline_app.command("unpin")
def unpin_cmd(run_id: int = typer.Argument(..., help="A pinned run's id."), history: Path = HistoryOpt) -> None:
    """Remove run ID's pin: its configuration's baseline is its newest passing run again."""
    run = hist.unpin(history, run_id)
    print(f"run {run.id} is no longer pinned; history:last-pass takes the newest passing run of its configuration")


@baseline_app.command("dirs")
def dirs_cmd(history: Path = HistoryOpt) -> None:
    """The run directories a baseline may still be read from (pinned runs, each configuration's newest pass), one
    per line: what a job that prunes old run directories must keep."""
    for path in hist.baseline_result_paths(history):
        print(safe(Path(path).parent))


@baseline_app.command("list")
def pins_cmd(history: Path = HistoryOpt) -> None:
    """Pinned runs, one per configuration, the pin made last first."""
    pins = hist.list_pins(history)
    if not pins:
        print(f"no pinned runs in {safe(history)}")
    for run, pinned_at in pins:
        print(f"run {run.id} pinned {safe(pinned_at)}: {safe(run.series)} ({run.outcome}, control "
              f"{_pct(run.control_rate)}, candidate {_pct(run.candidate_rate)})")
