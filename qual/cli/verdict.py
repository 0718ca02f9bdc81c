"""The few lines `qual run` and `qual compare` print: verdict, headline rates, each gate check, warnings. Names
and paths in them come from the user's files and arguments: every line is printed with its control characters
escaped (qual.shown.safe)."""

from __future__ import annotations

import sys
from pathlib import Path

from qual.outcomes import FAIL, INCONCLUSIVE, PASS, SKIPPED
from qual.shown import safe


def _say(line: str, stream=None) -> None:
    print(safe(line), file=stream or sys.stdout)


# A check's mark on stdout, by its outcome (qual.result.CheckResult.outcome)
MARKS = {PASS: "ok", FAIL: "FAIL", INCONCLUSIVE: "INCONCLUSIVE", SKIPPED: "skip"}


def print_verdict(result, control_label: str, candidate_label: str, report_dir: Path, night: int | None = None,
                  history: Path | None = None) -> None:
    """The verdict line, the baseline's lines, each gate check; night (its history id) and history name the night in
    the command that pins it."""
    # imported when used: every `qual` invocation loads this module
    from qual.report import baseline as bview
    from qual.report.common import inconclusive_note, interval_note, pct
    from qual.result import DECIDED_NOTHING, FIRST_NIGHT

    _say(f"{result.gate.word}: {control_label} {pct(result.control.acceptance.rate)} vs {candidate_label} "
          f"{pct(result.candidate.acceptance.rate)} acceptance; report {report_dir / 'report.html'}")
    note = interval_note(result)
    if note is not None:
        print(f"  note: {note}")
    if result.baseline is not None:
        rates = ", ".join(f"{arm} {pct(b.tonight_rate)} vs {pct(b.baseline_rate)}" for arm, b in result.baseline.arms.items()
                          if b.compared)
        _say(f"  baseline {result.baseline.label}: {rates or 'no arm compared'}")
        forced = bview.forced(result.baseline)
        if forced:  # a swapped drafter's first night: what differs from the series it is compared with
            pin = bview.pin_command(result.baseline, night, history)
            _say(f"  {forced}" + (f"; {bview.PIN_HINT}: {pin}" if pin else ""))
        if result.baseline.changed:
            _say(f"  changed since the baseline: {'; '.join(result.baseline.changed)}")
    elif result.first_night:
        _say(f"  {FIRST_NIGHT}")
    for check in result.gate.checks:
        _say(f"  [{MARKS[check.outcome]}] {check.name}: {check.detail}")
    if result.gate.decided_nothing:
        _say(f"  [FAIL] {DECIDED_NOTHING}")
    note = inconclusive_note(result.gate)
    if note:
        _say(f"  {note}")


def print_sweep_verdict(sweep, report_dir: Path) -> None:
    """A sweep's verdict line (the worst of its candidates'), then per candidate its verdict, rates and checks; the
    warnings and notes on stderr."""
    from qual.report import matrix

    rows = matrix.rows(sweep)
    few_units = matrix.interval_note(sweep)
    for note in sweep.notes:
        _say(f"note: {note}", sys.stderr)
    for name, result in sweep.results():
        for warning in result.warnings:
            _say(f"warning: {name}: {warning}", sys.stderr)
    _say(f"{'PASS' if sweep.passed else 'FAIL'}: {sum(r.passed for r in rows)}/{len(rows)} candidates passed against "
          f"{matrix.control_line(sweep)}; report {report_dir / 'report.html'}")
    if few_units is not None:
        print(f"  note: {few_units}")
    for row, (_, result) in zip(rows, sweep.results()):
        _say(f"  {row.verdict} {row.name} ({row.settings}): {row.rate}, delta {row.delta} {row.ci}, mean acceptance "
              f"length ratio {row.mal_ratio}")
        for check in result.gate.checks:
            _say(f"    [{MARKS[check.outcome]}] {check.name}: {check.detail}")


def print_warnings(result) -> None:
    """Provenance differences between the arms (engine version, dtype, GPU type), on stderr: one line each."""
    for warning in result.warnings:
        _say(f"warning: {warning}", sys.stderr)


def print_speedup(result) -> None:
    """`--speedup`: the per-request ratio with its interval and the bound, the batch's ratio, and whether they
    disagree, a line each after the gate checks (and the CPU caveat on the first)."""
    from qual.report.latency import CPU_SHORT, on_cpu, speedup_lines

    for i, line in enumerate(speedup_lines(result)):
        _say(f"  {line}" + (f" ({CPU_SHORT})" if i == 0 and on_cpu(result) else ""))
