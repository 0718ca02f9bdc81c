"""The history's rows: one a night (a finished run, or an error row for a run that ended without a verdict), written
and read back typed.

Every column is checked as it is read: a row edited by hand or written by another tool (a rate of 'abc' or -5, a
configuration of '{}', a BLOB where a path was) is exit 2 naming the row and the column, never a traceback.
"""

from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from qual.configuration import ConfigurationKey
from qual.errors import QualError
from qual.history import store
from qual.history.store import MAX_RUN_ID, begin_write, open_history, rollback
from qual.nights import FACTS, facts_of, qual_label
from qual.outcomes import ERROR, FAIL, INCONCLUSIVE, PASS
from qual.userfiles import load_json
from qual.validation import ascii_digits

# What a night ended as: a gate's verdict (an inconclusive gate exits 0 or 1 as the gate file says), or no verdict.
OUTCOMES = (PASS, FAIL, INCONCLUSIVE, ERROR)

COLUMNS = (
    "id", "created_at", "model", "engine", "engine_version", "dcp", "tp", "draft_kv", "config_key",
    "corpus_name", "corpus_fingerprint", "n_requests", "control_rate", "candidate_rate", "control_mal",
    "candidate_mal", "delta_rate", "ci_lo", "ci_hi", "verdict", "failed_checks", "result_path", "config_json",
    "run_id",
    "configuration", "baseline", "qual_commit",
    "outcome", "exit_code", "error", "command", "run_dir", "meta", "facts",
)
FILTERS = ("engine", "dcp", "tp", "draft_kv", "config_key", "corpus_name")


# Nights are in the order they were recorded (a row's id grows with each, and a resumed run keeps its error row's),
# never in the clock's: a runner whose clock ran ahead for a night, then was set right, would otherwise keep that
# night its series' newest (the last pass every later night is judged against, the latest on every list, trend and
# step change) until the clock caught up with it. created_at is what a night says of its time: shown and plotted.
NEWEST_FIRST = "ORDER BY id DESC"


def recorded_order(run: "HistoryRun") -> int:
    """A night's place among the history's nights, oldest first (the sort key of NEWEST_FIRST's order)."""
    return run.id


@dataclass(frozen=True)
class HistoryRun:
    """One recorded night (a row of `runs`)."""

    id: int
    created_at: str
    model: str
    engine: str
    engine_version: str | None
    dcp: int
    tp: int
    draft_kv: str
    config_key: str
    corpus_name: str
    corpus_fingerprint: str
    n_requests: int
    control_rate: float | None
    candidate_rate: float | None
    control_mal: float | None
    candidate_mal: float | None
    delta_rate: float | None
    ci_lo: float | None
    ci_hi: float | None
    verdict: str  # pass exactly where the run exited 0 (an inconclusive gate may); error rows: fail
    failed_checks: list[str]  # the checks that did not pass: failed or inconclusive
    result_path: str | None
    config: dict
    run_id: str | None = None  # the run directory's run.json run_id (None: recorded without one)
    configuration: str | None = None  # ConfigurationKey.key(); None: a row whose config names no candidate arm
    baseline: str | None = None  # the baseline this run was judged against, where it had one
    qual_commit: str | None = None  # the qual commit that produced the run (schema v4; None: a wheel, or before)
    outcome: str = PASS  # pass | fail | inconclusive | error
    exit_code: int | None = None  # the run's exit code (0 or 1 for a verdict; 2, 3, 4 or 130 for an error row)
    error: str | None = None  # an error row's cause, the line stderr showed
    command: str | None = None  # what ran: the `qual run` command that reproduces the night
    run_dir: str | None = None  # the night's output folder
    meta: dict[str, str] = field(default_factory=dict)  # qual run --meta KEY=VALUE
    facts: dict[str, str | None] = field(default_factory=dict)  # qual.nights.FACTS: the software and machine
    key: ConfigurationKey | None = field(default=None, compare=False)  # `configuration` read

    @property
    def is_error(self) -> bool:
        return self.outcome == ERROR

    @property
    def series(self) -> str:
        """The trend series a run belongs to: its configuration key's label (the model and the old config key for a
        row without one)."""
        return self.key.label() if self.key is not None else f"{self.model} {self.config_key}"

    @classmethod
    def from_row(cls, row: sqlite3.Row, path: str | Path) -> "HistoryRun":
        """The row, every column checked (QualError naming the row and column)."""
        names = set(row.keys())
        where = f"history {path}: run {row['id']}"
        d = {}
        for name in COLUMNS:
            if name not in names:
                continue
            read = _READERS[name]
            try:
                d[name] = read(row[name], f"{where}: {name}")
            except _Bad as bad:
                raise QualError(f"{where}: {name}: {bad}") from None
        d["config"] = d.pop("config_json")
        d["outcome"] = d.get("outcome") or d["verdict"]  # rows before outcomes: their verdict
        d["meta"] = d.get("meta") or {}
        d["facts"] = d.get("facts") or {"engine": d.get("engine_version"),
                                        "qual": qual_label(None, d.get("qual_commit"))}
        configuration = d.get("configuration")
        if configuration is not None:
            try:
                d["key"] = ConfigurationKey.from_key(configuration)
            except ValueError as exc:
                raise QualError(f"{where}: configuration: not a configuration key ({exc})") from None
        return cls(**d)


# ---------------------------------------------------------------- reading a column


class _Bad(Exception):
    """A column's value is not what qual wrote there."""


def _shown(value: Any) -> str:
    if isinstance(value, bytes):
        return f"a BLOB of {len(value)} bytes"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(nullable: bool = False) -> Callable[[Any, str], Any]:
    def read(v: Any, where: str) -> Any:
        if v is None and nullable:
            return None
        if not isinstance(v, str):
            raise _Bad(f"expected text, got {_shown(v)}")
        return v
    return read


def _integer(low: int, nullable: bool = False) -> Callable[[Any, str], Any]:
    def read(v: Any, where: str) -> Any:
        if v is None and nullable:
            return None
        if type(v) is not int or not low <= v <= MAX_RUN_ID:
            raise _Bad(f"expected an integer >= {low}, got {_shown(v)}")
        return v
    return read


def _number(low: float, high: float, what: str) -> Callable[[Any, str], Any]:
    def read(v: Any, where: str) -> Any:
        if v is None:
            return None
        if type(v) not in (int, float) or not math.isfinite(v) or not low <= v <= high:
            raise _Bad(f"expected {what}, got {_shown(v)}")
        return float(v)
    return read


def _one_of(values: tuple[str, ...], nullable: bool = False) -> Callable[[Any, str], Any]:
    def read(v: Any, where: str) -> Any:
        if (v is None and nullable) or v in values:
            return v
        raise _Bad(f"expected one of {', '.join(values)}, got {_shown(v)}")
    return read


def _json(expected: str, fits: Callable[[Any], bool], nullable: bool = False) -> Callable[[Any, str], Any]:
    """A JSON column's value, read by the bounded loader (deep nesting, a repeated key, a huge number refused). A
    damaged one (edited by hand, written by another tool) is the user's to repair or delete: one line naming the row
    and column, not a bug's traceback."""
    def read(v: Any, where: str) -> Any:
        if v is None and nullable:
            return None
        if not isinstance(v, str):  # SQLite keeps any type in a TEXT column (a number, NULL)
            raise _Bad(f"not JSON (a {type(v).__name__})")
        value = load_json(v, where)  # its QualError names the row, the column and the line
        if not fits(value):
            raise _Bad(f"expected {expected}, got {type(value).__name__}")
        return value
    return read


def _strings(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and (x is None or isinstance(x, str)) for k, x in v.items())


_RATE = _number(0.0, 1.0, "a rate in [0, 1]")
_MAL = _number(1.0, math.inf, "a mean acceptance length >= 1")
_DELTA = _number(-1.0, 1.0, "a rate difference in [-1, 1]")
# column -> read(value, where: the row and column) -> the value, or _Bad
_READERS: dict[str, Callable[[Any, str], Any]] = {
    "id": _integer(1), "created_at": _text(), "model": _text(), "engine": _text(), "engine_version": _text(True),
    "dcp": _integer(1), "tp": _integer(1), "draft_kv": _text(), "config_key": _text(), "corpus_name": _text(),
    "corpus_fingerprint": _text(), "n_requests": _integer(0), "control_rate": _RATE, "candidate_rate": _RATE,
    "control_mal": _MAL, "candidate_mal": _MAL, "delta_rate": _DELTA, "ci_lo": _DELTA, "ci_hi": _DELTA,
    "verdict": _one_of((PASS, FAIL)),
    "failed_checks": _json("a list of check names", lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v)),
    "result_path": _text(True), "config_json": _json("an object", lambda v: isinstance(v, dict)),
    "run_id": _text(True), "configuration": _text(True), "baseline": _text(True), "qual_commit": _text(True),
    "outcome": _one_of(OUTCOMES, True), "exit_code": _integer(0, True), "error": _text(True), "command": _text(True),
    "run_dir": _text(True), "meta": _json("an object of texts", _strings, True),
    "facts": _json("an object of texts", _strings, True),
}
assert set(_READERS) == set(COLUMNS)


# ---------------------------------------------------------------- writing


def config_key(result) -> str:
    """A short label of the candidate's settings, kept in the `config_key` column for readers of older histories;
    series and baselines use the configuration key (qual.configuration)."""
    return _config_key(result.candidate.config, result.corpus.name)


def _config_key(k: dict, corpus_name: str) -> str:
    s = k.get("sampling") or {}
    return (
        f"{k.get('engine')} dcp{k.get('dcp')} tp{k.get('tp')} kv={k.get('draft_kv')} "
        f"k={k.get('num_speculative_tokens')} T={s.get('temperature')} {k.get('dtype')} {k.get('device')} "
        f"corpus={corpus_name}"
    )


def record_run(db_path: str | Path, result, result_path: str | Path | None, run_id: str | None = None,
               on_wait: Callable[[str], None] | None = None) -> int:
    """Record a run with a verdict (a qual.result.Result); returns its row id. A run_id already recorded adds nothing
    (the row it has), unless that row is the run's error row (an interrupted run, resumed): the real row replaces it,
    under its id.

    A database another process is writing is waited for (on_wait hears of it once), up to LOCK_TIMEOUT_S; then
    HistoryLocked."""
    k = result.candidate.config
    cmp = result.comparison
    ci = cmp.delta_rate_ci95 or [None, None]
    facts = facts_of(result)
    values = {
        "created_at": result.created_at,
        "model": str(k.get("model")),
        "engine": str(k.get("engine")),
        "engine_version": result.candidate.engine_version,
        "dcp": int(k.get("dcp")),
        "tp": int(k.get("tp")),
        "draft_kv": str(k.get("draft_kv")),
        "config_key": config_key(result),
        "corpus_name": result.corpus.name,
        "corpus_fingerprint": result.corpus.fingerprint,
        "n_requests": len(result.control.per_request),
        "control_rate": result.control.acceptance.rate,
        "candidate_rate": result.candidate.acceptance.rate,
        "control_mal": result.control.acceptance.mean_acceptance_length,
        "candidate_mal": result.candidate.acceptance.mean_acceptance_length,
        "delta_rate": cmp.delta_rate,
        "ci_lo": ci[0],
        "ci_hi": ci[1],
        "verdict": PASS if result.gate.passed else FAIL,
        "failed_checks": json.dumps([c.name for c in result.gate.not_passed]),
        "result_path": str(result_path) if result_path is not None else None,
        "config_json": json.dumps({"control": result.control.config, "candidate": k}, sort_keys=True),
        "run_id": run_id,
        "configuration": ConfigurationKey.of_result(result).key(),
        "baseline": result.baseline.label if result.baseline is not None else None,
        "qual_commit": result.candidate.provenance.qual_commit if result.candidate.provenance is not None else None,
        "outcome": result.gate.outcome,
        "exit_code": 0 if result.gate.passed else 1,
        "error": None,
        "command": result.reproduce or None,
        "run_dir": str(Path(result_path).parent) if result_path is not None else None,
        "meta": json.dumps(result.meta, sort_keys=True),
        "facts": json.dumps(facts, sort_keys=True),
    }
    return _write(db_path, values, run_id, on_wait, store.LOCK_TIMEOUT_S)


@dataclass(frozen=True)
class ErrorNight:
    """A run that ended in exit 2, 3, 4 or 130 after its output folder existed: what ran, and why it ended."""

    created_at: str
    run_id: str | None
    arms: dict[str, dict]  # control and candidate configs (ArmConfig.to_json)
    corpus: dict  # name, fingerprint, count
    key: ConfigurationKey
    exit_code: int
    cause: str  # the one line stderr showed
    command: str  # the `qual run` that reproduces it
    run_dir: str
    meta: dict[str, str] = field(default_factory=dict)
    facts: dict[str, str | None] = field(default_factory=dict)
    qual_commit: str | None = None  # the qual commit that ran it (None: a wheel), as a verdict row records it


def record_error(db_path: str | Path, night: ErrorNight, on_wait: Callable[[str], None] | None = None,
                 wait_s: float | None = None) -> int:
    """Record an error row (outcome error, no rates; never a baseline); returns its id. The run's earlier error row
    (a resumed run that ended without a verdict again) is replaced; a row with a verdict is kept as it is."""
    k = night.arms["candidate"]
    values = {
        "created_at": night.created_at, "model": str(k.get("model")), "engine": str(k.get("engine")),
        "engine_version": night.facts.get("engine"), "dcp": int(k.get("dcp")), "tp": int(k.get("tp")),
        "draft_kv": str(k.get("draft_kv")), "config_key": _config_key(k, str(night.corpus["name"])),
        "corpus_name": str(night.corpus["name"]), "corpus_fingerprint": str(night.corpus["fingerprint"]),
        "n_requests": int(night.corpus["count"]), "control_rate": None, "candidate_rate": None, "control_mal": None,
        "candidate_mal": None, "delta_rate": None, "ci_lo": None, "ci_hi": None, "verdict": FAIL,
        "failed_checks": "[]", "result_path": None,
        "config_json": json.dumps({"control": night.arms["control"], "candidate": k}, sort_keys=True),
        "run_id": night.run_id, "configuration": night.key.key(), "baseline": None,
        "qual_commit": night.qual_commit, "outcome": ERROR, "exit_code": night.exit_code, "error": night.cause,
        "command": night.command, "run_dir": night.run_dir, "meta": json.dumps(night.meta, sort_keys=True),
        "facts": json.dumps({name: night.facts.get(name) for name in FACTS}, sort_keys=True),
    }
    return _write(db_path, values, night.run_id, on_wait, store.LOCK_TIMEOUT_S if wait_s is None else wait_s)


def _write(db_path: str | Path, values: dict, run_id: str | None, on_wait: Callable[[str], None] | None,
           wait_s: float) -> int:
    """Insert the row, or replace the run's error row (run_id recorded as an error); a run recorded with a verdict
    keeps its row."""
    cols = ", ".join(values)
    marks = ", ".join(f":{c}" for c in values)
    with open_history(db_path, create=True) as conn:
        begin_write(conn, Path(db_path), on_wait, wait_s)
        try:
            row = conn.execute("SELECT id, outcome FROM runs WHERE run_id = ?", (run_id,)).fetchone() if run_id else None
            if row is None:
                row_id = conn.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", values).lastrowid
            else:
                row_id = row["id"]
                if row["outcome"] == ERROR:
                    sets = ", ".join(f"{c} = :{c}" for c in values)
                    conn.execute(f"UPDATE runs SET {sets} WHERE id = :id", {**values, "id": row_id})
            conn.execute("COMMIT")
        except BaseException:
            rollback(conn)
            raise
        return int(row_id)


# ---------------------------------------------------------------- reading


def _where(model: str | None, filters: dict[str, Any]) -> tuple[str, list]:
    bad = sorted(set(filters) - set(FILTERS))
    if bad:
        raise QualError(f"unknown history filter(s) {bad} (known: {', '.join(FILTERS)})")
    clauses, args = [], []
    if model is not None:
        clauses.append("model = ?")
        args.append(model)
    for name, value in filters.items():
        if value is not None:
            clauses.append(f"{name} = ?")
            args.append(value)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


def list_runs(db_path: str | Path, *, model: str | None = None, limit: int | None = 50, **filters: Any) -> list[HistoryRun]:
    """Recorded runs, newest first."""
    where, args = _where(model, filters)
    sql = f"SELECT * FROM runs{where} {NEWEST_FIRST}"
    if limit is not None:
        sql += " LIMIT ?"
        args.append(int(limit))
    return select(db_path, sql, args)


def select(db_path: str | Path, sql: str, args: list | tuple = ()) -> list[HistoryRun]:
    """The rows a query over `runs` gives, read typed."""
    with open_history(db_path, create=False) as conn:
        return [HistoryRun.from_row(r, db_path) for r in conn.execute(sql, args)]


def count_runs(db_path: str | Path) -> int:
    """How many runs the history holds (what a listing that matched none is measured against)."""
    with open_history(db_path, create=False) as conn:
        return int(conn.execute("SELECT count(*) FROM runs").fetchone()[0])


def get_run(db_path: str | Path, run_id: int) -> HistoryRun:
    """One run by id (QualError if absent)."""
    if not 1 <= run_id <= MAX_RUN_ID:
        raise QualError(f"no run {run_id} in {db_path} (run ids are 1 to {MAX_RUN_ID})")
    found = select(db_path, "SELECT * FROM runs WHERE id = ?", (int(run_id),))
    if not found:
        raise QualError(f"no run {run_id} in {db_path}")
    return found[0]


def find_night(db_path: str | Path, ref: str) -> list[HistoryRun]:
    """The rows of one night: a history id's run, or every row of the newest night recorded from a run directory (a
    sweep records a row per candidate, each of its own series, under run ids `<night>/<candidate>`)."""
    if ascii_digits(ref):
        digits = ref.lstrip("0") or "0"
        if len(digits) > len(str(MAX_RUN_ID)):
            raise QualError(f"no run {ref} in {db_path} (run ids are 1 to {MAX_RUN_ID})")
        return [get_run(db_path, int(digits))]
    folder = Path(ref).resolve()
    found: list[HistoryRun] = []
    for run in select(db_path, f"SELECT * FROM runs {NEWEST_FIRST}"):
        recorded = run.run_dir or (str(Path(run.result_path).parent) if run.result_path else None)
        if recorded is None or Path(recorded).resolve() != folder:
            continue
        if found and _night_of(run) != _night_of(found[0]):
            break  # an earlier night recorded from the same folder
        found.append(run)
    if not found:
        raise QualError(f"no run recorded from the folder {ref} in {db_path} (give a run id from `qual history list`)")
    return sorted(found, key=lambda r: r.id)


def _night_of(run: HistoryRun) -> str | None:
    """The night a row belongs to: its run id, a sweep candidate's without the candidate's name."""
    return run.run_id.partition("/")[0] if run.run_id else None
