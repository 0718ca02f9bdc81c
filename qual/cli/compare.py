"""`qual compare A B`: two arms from earlier runs, same outputs as `qual run`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qual.cli.crash import crash_report
from qual.cli.main import EXIT_GATE_FAILED, app
from qual.cli.outputs import check_before_work, holds_run
from qual.cli.verdict import print_verdict, print_warnings
from qual.errors import QualError
from qual.userfiles import check_path_name


def _refuse_used_folder(out: Path, *refs: str) -> None:
    """--out must be new or empty, as `qual run`'s: the reports would replace files of a run, an input's result.json,
    an earlier comparison's reports or whatever else lies there. A run or an input is named as such."""
    from qual.harness.compare import parse_ref

    if not out.is_dir():
        return
    found = holds_run(out)
    if found is not None:
        raise QualError(f"--out {out}: holds a run ({found}); its reports would be overwritten: give another "
                        "directory")
    for ref in refs:
        result = parse_ref(ref)[0]
        if result.resolve().parent == out.resolve():
            raise QualError(f"--out {out}: holds {result.name}, an input of this comparison ({ref}): give "
                            "another directory")
    try:
        names = sorted(entry.name for entry in out.iterdir())
    except OSError as exc:
        raise QualError(f"--out {out}: cannot list this directory ({exc.strerror or exc})") from None
    if names:
        raise QualError(f"--out {out}: is not empty ({names[0]}{', ...' if len(names) > 1 else ''}); the reports "
                        "would overwrite what it holds: give another directory")


@app.command("compare")
def compare_command(
    a: str = typer.Argument(..., metavar="CONTROL", help="Control: RESULT[:ARM] (result.json or run dir; ARM control|candidate, default "
                            "candidate; a sweep's: control or a candidate's name, candidate-dcp2-sharded)."),
    b: str = typer.Argument(..., metavar="CANDIDATE", help="Candidate: RESULT[:ARM]."),
    out: Path = typer.Option(..., "--out", help="Directory for result.json, report.html, summary.md, junit.xml."),
    gate: Optional[str] = typer.Option(None, "--gate", help="Gate rules YAML (default: the shipped nightly.yaml)."),
    history: Optional[str] = typer.Option(None, "--history", help="Also record the comparison in this history database."),
    seed: int = typer.Option(0, "--seed", min=0, help="Bootstrap seed."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict as JSON (schema qual.verdict/1: outcome, "
                                 "exit code, each arm's headline, every check with its numbers, the reports' paths) "
                                 "instead of its lines; warnings still go to stderr."),
) -> None:
    """Compare two arms of earlier results (same corpus fingerprint and sampling, else exit 2)."""
    from qual.harness.compare import compare
    from qual.paths import default_gate
    from qual.history import record_run
    from qual.report import write_reports
    from qual.report.junit import gate_suite

    check_path_name(out, "--out")
    result = compare(a, b, str(gate or default_gate()), seed)  # mismatched inputs: exit 2 before anything is made
    _refuse_used_folder(out, a, b)
    check_before_work(out, Path(history) if history else None)  # the history as `qual run` checks it
    cfg = result.candidate.config
    # From here on a bug's traceback goes to <out>/crash.txt, and junit.xml names it.
    with crash_report(out, gate_suite(cfg.get("model", "model"), cfg.get("dcp", "?"))):
        paths = write_reports(result, out)
        if history:
            record_run(history, result, paths["json"])
        print_warnings(result)
        if as_json:
            from qual.report.json import verdict_text

            print(verdict_text(result, a, b, paths))
        else:
            print_verdict(result, a, b, out)
    if not result.gate.passed:
        raise typer.Exit(EXIT_GATE_FAILED)
