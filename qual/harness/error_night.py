"""A night that ends without a verdict still leaves a row: a run that ends in exit 2, 3, 4 or 130 after its output
folder existed is recorded in the history as an error row (the exit code, the one-line cause, what ran) and writes
summary.md saying why. An error row is never a baseline; the run's real row replaces it when `--resume` finishes it.

Best effort by design: the error being reported is what counts (its exit code and its line on stderr), so a history
that cannot take the row at once (locked, full disk) or a summary that cannot be written changes nothing else.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import qual
from qual import shown, stop_signals
from qual.errors import EngineError, InternalError
from qual.history import ErrorNight, record_error
from qual.nights import qual_label
from qual.provenance import qual_commit
from qual.redact import redact_text
from qual.report import FILES
from qual.report.markdown import ErrorSummary, write_error

LOCK_WAIT_S = 2.0  # an error row waits this long for a history another process writes (an interrupt has 8 s in all)


def describe(exc: BaseException) -> tuple[int, str, str]:
    """(exit code, what kind of end, the line stderr shows) of an exception that ends a run without a verdict."""
    if isinstance(exc, KeyboardInterrupt):
        import signal

        name = signal.Signals(stop_signals.received).name if stop_signals.received else "SIGINT"
        return 130, "interrupted", f"interrupted ({name})"
    if isinstance(exc, EngineError):
        return 3, "engine failure", f"engine failure: {exc}"
    if isinstance(exc, InternalError):
        return 4, "internal error", str(exc)
    return 2, "usage, configuration, input or output error", f"error: {exc}"


def _title(arm: dict) -> str:
    return (f"{arm.get('model')}: DCP 1 \u2192 DCP {arm.get('dcp')} ({arm.get('engine')}, TP {arm.get('tp')}, "
            f"draft KV {arm.get('draft_kv')})")


def record_error_night(plan, exc: BaseException) -> None:
    """summary.md and an error row per candidate for a run (a RunPlan) that ended in exc. A run whose result.json was
    written before it ended (a report that failed after it, a history locked past the wait) keeps its reports: the
    row says how it ended, and `--resume` records the verdict in its place."""
    code, what, line = describe(exc)
    line = shown.safe(redact_text(" ".join(line.split())))
    command = plan.options.command(plan.engine)
    first = plan.arms[plan.candidates[0]].to_json()
    if not (plan.out_dir / FILES["json"]).exists():
        try:
            write_error(ErrorSummary(_title(first), code, what, line, command, shown.command(
                ["qual", "run", "--resume", plan.out_dir])), plan.out_dir / FILES["markdown"])
        except Exception:  # noqa: BLE001 - a full disk, or a bug here: the exit code and stderr's line say it
            pass
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    commit, dirty = qual_commit()
    facts = {"engine": plan.engine_version, "qual": qual_label(qual.__version__, commit, dirty)}
    control = plan.arms["control"].to_json()
    for name in plan.candidates:
        run_id = f"{plan.run_id}/{name}" if plan.is_sweep else plan.run_id
        night = ErrorNight(created_at=created, run_id=run_id,
                           arms={"control": control, "candidate": plan.arms[name].to_json()},
                           corpus=plan.corpus_info, key=plan.configuration_of(name), exit_code=code, cause=line,
                           command=command, run_dir=str(Path(plan.out_dir)), meta=dict(plan.options.meta or {}),
                           facts=facts, qual_commit=commit)
        try:
            record_error(plan.history_path, night, wait_s=LOCK_WAIT_S)
        except Exception:  # noqa: BLE001 - locked, full, damaged (sqlite3.DatabaseError) or a bug here: the error
            return  # being reported keeps its exit code and its line on stderr, which say what happened
