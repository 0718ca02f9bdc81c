"""Which recorded night a run is compared with: its series' pin, else its series' last pass; for a series without
either, the last pass of the series before it (another drafter or target, another selection of the same corpus), or
of the nearest key with `--baseline-any`. Only a night whose gate passed outright is a last pass: an inconclusive
night never is, whatever it exited with, and an error row never serves."""

from __future__ import annotations

from pathlib import Path

from qual.configuration import ConfigurationKey, is_successor
from qual.errors import QualError
from qual.history.runs import ERROR, PASS, HistoryRun, get_run, newest_first, select
from qual.history.store import NEWEST_PIN_FIRST, open_history


def configuration_of(result) -> ConfigurationKey:
    """The configuration key a result belongs to (qual.configuration)."""
    return ConfigurationKey.of_result(result)


def configuration_runs(db_path: str | Path, configuration: ConfigurationKey, limit: int | None = None) -> list[HistoryRun]:
    """Runs of one configuration, newest first."""
    sql = f"SELECT * FROM runs WHERE configuration = ? {newest_first()}"
    args: list = [configuration.key()]
    if limit is not None:
        sql += " LIMIT ?"
        args.append(int(limit))
    return select(db_path, sql, args)


def last_pass(db_path: str | Path, configuration: ConfigurationKey) -> HistoryRun | None:
    """The newest night of this configuration whose gate passed (not an inconclusive one that exited 0)."""
    found = select(db_path, f"SELECT * FROM runs WHERE configuration = ? AND outcome = ? {newest_first()} LIMIT 1",
                   (configuration.key(), PASS))
    return found[0] if found else None


def model_passes(db_path: str | Path, model: str) -> list[HistoryRun]:
    """Every passing night of the model, newest first: what nearest_pass and previous_series_pass choose among (read
    once by history:last-pass for both)."""
    return select(db_path, "SELECT * FROM runs WHERE model = ? AND outcome = ? AND configuration IS NOT NULL "
                           f"{newest_first()}", (model, PASS))


def nearest_pass(passes: list[HistoryRun], configuration: ConfigurationKey) -> HistoryRun | None:
    """Of the model's passes (model_passes), the one whose configuration differs from this one in the fewest fields
    (the newest of those): what `--baseline-any` compares with, and what a refusal names."""
    if not passes:
        return None
    return min(passes, key=lambda r: len(configuration.differences(r.key)))  # min keeps the first (newest) of a tie


def previous_series_pass(passes: list[HistoryRun], configuration: ConfigurationKey) -> HistoryRun | None:
    """Of the model's passes (model_passes), the last pass of the series this one follows: a key that differs only
    in the checkpoints' identities or the selection of the same corpus (qual.configuration.SUCCESSOR_FIELDS); of
    several, the fewest differences, then the newest."""
    rows = [r for r in passes if is_successor(configuration, r.key)]
    return min(rows, key=lambda r: len(configuration.differences(r.key, unknown_matches=True))) if rows else None


def pinned_run(db_path: str | Path, configuration: ConfigurationKey) -> HistoryRun | None:
    """The run pinned as this configuration's baseline, if one is."""
    found = select(db_path, "SELECT runs.* FROM pins JOIN runs ON runs.id = pins.run_id WHERE pins.configuration = ?",
                   (configuration.key(),))
    return found[0] if found else None


def baseline_result_paths(db_path: str | Path) -> list[str]:
    """The result files a baseline may still be read from: each pinned run's, and each configuration's newest passing
    run's (what `history:last-pass` picks, for its own series and for the series after it, and `--baseline-any`
    nearest among). Paths as recorded, sorted."""
    with open_history(db_path, create=False) as conn:
        rows = conn.execute(
            "SELECT result_path FROM runs WHERE id IN (SELECT run_id FROM pins) UNION "
            "SELECT (SELECT result_path FROM runs AS r WHERE r.configuration = c.configuration AND r.outcome = ? "
            f"{newest_first('r')} LIMIT 1) FROM (SELECT DISTINCT configuration FROM runs) AS c",
            (PASS,)).fetchall()
    return sorted({p for (p,) in rows if p})


def pin(db_path: str | Path, run_id: int, pinned_at: str) -> tuple[HistoryRun, int | None]:
    """Make run_id the baseline of its configuration; returns the run and the run it replaces (if any)."""
    run = get_run(db_path, run_id)
    if run.configuration is None:
        raise QualError(f"run {run_id}: its recorded config names no candidate arm, so it has no configuration to pin")
    if run.outcome == ERROR:
        raise QualError(f"run {run_id} ended without a verdict (exit {run.exit_code}: {run.error}); it measured nothing "
                        "to compare with")
    with open_history(db_path, create=False) as conn, conn:
        old = conn.execute("SELECT run_id FROM pins WHERE configuration = ?", (run.configuration,)).fetchone()
        conn.execute("INSERT OR REPLACE INTO pins (configuration, run_id, pinned_at) VALUES (?, ?, ?)",
                     (run.configuration, run.id, pinned_at))
    previous = int(old[0]) if old is not None else None
    return run, previous if previous != run.id else None


def unpin(db_path: str | Path, run_id: int) -> HistoryRun:
    """Remove run_id's pin (QualError if it is not pinned): its configuration falls back to its last pass."""
    run = get_run(db_path, run_id)
    with open_history(db_path, create=False) as conn, conn:
        gone = conn.execute("DELETE FROM pins WHERE run_id = ?", (run.id,)).rowcount
    if not gone:
        raise QualError(f"run {run_id} is not pinned (`qual history baseline list` shows the pins)")
    return run


def list_pins(db_path: str | Path) -> list[tuple[HistoryRun, str]]:
    """Every pinned run and when it was pinned, the pin made last first (NEWEST_PIN_FIRST: not by the clock)."""
    with open_history(db_path, create=False) as conn:
        rows = conn.execute(
            f"SELECT runs.*, pins.pinned_at AS pinned_at FROM pins JOIN runs ON runs.id = pins.run_id {NEWEST_PIN_FIRST}"
        ).fetchall()
        return [(HistoryRun.from_row(r, db_path), r["pinned_at"]) for r in rows]
