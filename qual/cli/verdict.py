"""The few lines `qual run` and `qual compare` print: verdict, headline rates, each gate check, warnings."""

from __future__ import annotations

from pathlib import Path


def print_verdict(result, control_label: str, candidate_label: str, report_dir: Path) -> None:
    from qual.report.common import pct  # imported when used: every `qual` invocation loads this module
    from qual.result import DECIDED_NOTHING

    verdict = "PASS" if result.gate.passed else "FAIL"
    print(f"{verdict}: {control_label} {pct(result.control.acceptance.rate)} vs {candidate_label} "
          f"{pct(result.candidate.acceptance.rate)} acceptance; report {report_dir / 'report.html'}")
    if result.baseline is not None:
        rates = ", ".join(f"{arm} {pct(b.tonight_rate)} vs {pct(b.baseline_rate)}" for arm, b in result.baseline.arms.items()
                          if b.compared)
        print(f"  baseline {result.baseline.label}: {rates or 'no arm compared'}")
    for check in result.gate.checks:
        mark = "skip" if check.skipped else "ok" if check.passed else "FAIL"
        print(f"  [{mark}] {check.name}: {check.detail}")
    if result.gate.decided_nothing:
        print(f"  [FAIL] {DECIDED_NOTHING}")


def print_sweep_verdict(sweep, report_dir: Path) -> None:
    """A sweep's verdict line (the worst of its candidates'), then per candidate its verdict, rates and checks; the
    warnings and notes on stderr."""
    import sys

    from qual.report import matrix

    rows = matrix.rows(sweep)
    for note in sweep.notes:
        print(f"note: {note}", file=sys.stderr)
    for name, result in sweep.results():
        for warning in result.warnings:
            print(f"warning: {name}: {warning}", file=sys.stderr)
    print(f"{'PASS' if sweep.passed else 'FAIL'}: {sum(r.passed for r in rows)}/{len(rows)} candidates passed against "
          f"{matrix.control_line(sweep)}; report {report_dir / 'report.html'}")
    for row, (_, result) in zip(rows, sweep.results()):
        print(f"  {row.verdict} {row.name} ({row.settings}): {row.rate}, delta {row.delta} {row.ci}, mean acceptance "
              f"length ratio {row.mal_ratio}")
        for check in result.gate.checks:
            mark = "skip" if check.skipped else "ok" if check.passed else "FAIL"
            print(f"    [{mark}] {check.name}: {check.detail}")


def print_warnings(result) -> None:
    """Provenance differences between the arms (engine version, dtype, GPU type), on stderr: one line each."""
    import sys

    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)


def print_speedup(result) -> None:
    """`--speedup`: the per-request ratio with its interval and the bound, the batch's ratio, and whether they
    disagree, a line each after the gate checks (and the CPU caveat on the first)."""
    from qual.report.latency import CPU_SHORT, on_cpu, speedup_lines

    for i, line in enumerate(speedup_lines(result)):
        print(f"  {line}" + (f" ({CPU_SHORT})" if i == 0 and on_cpu(result) else ""))
