"""Run history in SQLite: one row per completed run, trends per model/config, step-change detection."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from qual.configuration import ConfigurationKey, dcp_comm_of, numerics_of
from qual.errors import QualError
from qual.result import Result
from qual.userfiles import check_path_name, load_json

SCHEMA_VERSION = 6
DEFAULT_STEP_PP = 2.0
LOCK_TIMEOUT_S = 30.0  # how long a writer waits for another process's transaction
MAX_RUN_ID = 2**63 - 1  # SQLite's largest INTEGER PRIMARY KEY: a larger id names no run (and cannot be bound)

_SCHEMA_V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at TEXT NOT NULL,
    model TEXT NOT NULL,
    engine TEXT NOT NULL,
    engine_version TEXT,
    dcp INTEGER NOT NULL,
    tp INTEGER NOT NULL,
    draft_kv TEXT NOT NULL,
    config_key TEXT NOT NULL,          -- the series a run belongs to (besides model)
    corpus_name TEXT NOT NULL,
    corpus_fingerprint TEXT NOT NULL,
    n_requests INTEGER NOT NULL,
    control_rate REAL,
    candidate_rate REAL,
    control_mal REAL,
    candidate_mal REAL,
    delta_rate REAL,
    ci_lo REAL,
    ci_hi REAL,
    verdict TEXT NOT NULL CHECK (verdict IN ('pass', 'fail')),
    failed_checks TEXT NOT NULL,       -- JSON list of check names
    result_path TEXT,
    config_json TEXT NOT NULL          -- {"control": ArmConfig json, "candidate": ...}
);
CREATE INDEX runs_series ON runs (model, config_key, created_at);
"""


def _migrate_v1_to_v2(conn: sqlite3.Connection) -> None:
    # A run (its run.json's run_id) is recorded once: resuming a finished run does not add a second row.
    conn.execute("ALTER TABLE runs ADD COLUMN run_id TEXT")
    conn.execute("CREATE UNIQUE INDEX runs_run_id ON runs (run_id)")


def _configuration_of_row(config_json: str, corpus_fingerprint: str, n_requests: int,
                          engine_version: str | None = None) -> str | None:
    """The configuration key of a row recorded before its key was (checkpoint identities unknown: qual recorded none
    then). None for a row whose stored config names no candidate arm: it stays listed but never serves as a baseline
    (a migration that stopped on one odd row would lock the whole history)."""
    try:
        candidate = load_json(config_json, "config_json")["candidate"]
        return ConfigurationKey.of(candidate, corpus_fingerprint, n_requests, engine_version, None).key()
    except (QualError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _migrate_v2_to_v3(conn: sqlite3.Connection) -> None:
    """Baselines: each run's configuration (what history:last-pass selects on), the baseline it was judged against,
    and one pinned run per configuration. Runs recorded before get their configuration from their stored config
    (n_requests stands for the replayed selection: they are equal whenever the control arm ran)."""
    conn.execute("ALTER TABLE runs ADD COLUMN configuration TEXT")
    conn.execute("ALTER TABLE runs ADD COLUMN baseline TEXT")
    conn.execute("CREATE TABLE pins (configuration TEXT PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs (id), "
                 "pinned_at TEXT NOT NULL)")
    conn.execute("CREATE INDEX runs_configuration ON runs (configuration, created_at)")
    _rekey(conn)


def _rekey(conn: sqlite3.Connection) -> None:
    """Every row's configuration key recomputed from what it recorded, and each pin moved to its run's new key."""
    rows = conn.execute("SELECT id, config_json, corpus_fingerprint, n_requests, engine_version FROM runs").fetchall()
    for run_id, config_json, fingerprint, n, version in rows:
        conn.execute("UPDATE runs SET configuration = ? WHERE id = ?",
                     (_configuration_of_row(config_json, fingerprint, n, version), run_id))
    conn.execute("DELETE FROM pins WHERE run_id NOT IN (SELECT id FROM runs WHERE configuration IS NOT NULL)")
    conn.execute("UPDATE pins SET configuration = (SELECT configuration FROM runs WHERE runs.id = pins.run_id)")


def _migrate_v3_to_v4(conn: sqlite3.Connection) -> None:
    """The configuration key gains the engine version, the checkpoints' identities, the interleave, draft-KV and
    sparse top-k modes (qual.configuration); rows get the qual commit that produced them."""
    conn.execute("ALTER TABLE runs ADD COLUMN qual_commit TEXT")
    _rekey(conn)


def _migrate_v4_to_v5(conn: sqlite3.Connection) -> None:
    """The configuration key gains the DCP merge path (dcp_comm), read from each row's stored candidate config."""
    _extend_keys(conn, "dcp_comm", dcp_comm_of)


def _migrate_v5_to_v6(conn: sqlite3.Connection) -> None:
    """The configuration key gains the target's numerics, read from each row's stored candidate config (a GLM run
    recorded before it computed exact: qual.configuration.numerics_of)."""
    _extend_keys(conn, "numerics", numerics_of)


def _extend_keys(conn: sqlite3.Connection, name: str, value_of: Callable[[dict], str]) -> None:
    """Each row's stored configuration key gains field `name`, value_of(its stored candidate config); the rest of the
    key stays as recorded (a recomputation would lose the checkpoints' identities), written in ConfigurationKey.key()'s
    canonical form, and pins follow their runs. A row whose key cannot be read keeps none (listed, never a baseline)."""
    rows = conn.execute("SELECT id, config_json, configuration FROM runs WHERE configuration IS NOT NULL").fetchall()
    for run_id, config_json, configuration in rows:
        try:
            key = load_json(configuration, "configuration")
            key[name] = value_of(load_json(config_json, "config_json")["candidate"])
            new = json.dumps(key, sort_keys=True, separators=(",", ":"))
        except (QualError, ValueError, KeyError, TypeError, AttributeError):
            new = None
        conn.execute("UPDATE runs SET configuration = ? WHERE id = ?", (new, run_id))
    conn.execute("DELETE FROM pins WHERE run_id NOT IN (SELECT id FROM runs WHERE configuration IS NOT NULL)")
    conn.execute("UPDATE pins SET configuration = (SELECT configuration FROM runs WHERE runs.id = pins.run_id)")


# version v -> function migrating a v database to v+1 (inside the open transaction). A new database is
# created at v1 and migrated, in the same transaction: one spelling of the schema.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: _migrate_v1_to_v2, 2: _migrate_v2_to_v3,
                                                               3: _migrate_v3_to_v4, 4: _migrate_v4_to_v5,
                                                               5: _migrate_v5_to_v6}

_COLUMNS = (
    "id", "created_at", "model", "engine", "engine_version", "dcp", "tp", "draft_kv", "config_key",
    "corpus_name", "corpus_fingerprint", "n_requests", "control_rate", "candidate_rate", "control_mal",
    "candidate_mal", "delta_rate", "ci_lo", "ci_hi", "verdict", "failed_checks", "result_path", "config_json",
    "run_id",
    "configuration", "baseline", "qual_commit",
)
FILTERS = ("engine", "dcp", "tp", "draft_kv", "config_key", "corpus_name")


@dataclass(frozen=True)
class HistoryRun:
    """One recorded run (a row of `runs`)."""

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
    verdict: str
    failed_checks: list[str]
    result_path: str | None
    config: dict
    run_id: str | None = None  # the run directory's run.json run_id (None: recorded without one)
    configuration: str | None = None  # ConfigurationKey.key(); None: a row whose config names no candidate arm
    baseline: str | None = None  # the baseline this run was judged against, where it had one
    qual_commit: str | None = None  # the qual commit that produced the run (schema v4; None: a wheel, or before)

    @property
    def key(self) -> ConfigurationKey | None:
        return ConfigurationKey.from_key(self.configuration) if self.configuration else None

    @property
    def series(self) -> str:
        """The trend series a run belongs to: its configuration key's label (the model and the old config key for a
        row without one)."""
        key = self.key
        return key.label() if key is not None else f"{self.model} {self.config_key}"

    @classmethod
    def from_row(cls, row: sqlite3.Row, path: str | Path) -> "HistoryRun":
        d = {k: row[k] for k in _COLUMNS if k in row.keys()}
        where = f"history {path}: run {d['id']}"
        d["failed_checks"] = _stored_json(d["failed_checks"], f"{where}: failed_checks", "a list of check names",
                                          lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v))
        d["config"] = _stored_json(d.pop("config_json"), f"{where}: config_json", "an object",
                                   lambda v: isinstance(v, dict))
        return cls(**d)


def _stored_json(text: Any, where: str, expected: str, fits: Callable[[Any], bool]) -> Any:
    """A JSON column's value. A damaged one (edited by hand, written by another tool) is the user's to repair or
    delete: one line naming the row and column, not a bug's traceback."""
    if not isinstance(text, str):  # SQLite keeps any type in a TEXT column (a number, NULL)
        raise QualError(f"{where}: not JSON (a {type(text).__name__})")
    value = load_json(text, where)  # bounded: deep nesting, a repeated key, a huge number are refused
    if not fits(value):
        raise QualError(f"{where}: expected {expected}, got {type(value).__name__}")
    return value


def config_key(result: Result) -> str:
    """A short label of the candidate's settings, kept in the `config_key` column for readers of older histories;
    series and baselines use the configuration key (qual.configuration)."""
    k = result.candidate.config
    s = k.get("sampling") or {}
    return (
        f"{k.get('engine')} dcp{k.get('dcp')} tp{k.get('tp')} kv={k.get('draft_kv')} "
        f"k={k.get('num_speculative_tokens')} T={s.get('temperature')} {k.get('dtype')} {k.get('device')} "
        f"corpus={result.corpus.name}"
    )


# ---------------------------------------------------------------- connection and schema


def _schema_state(conn: sqlite3.Connection, path: Path) -> int | None:
    """The database's schema version, None when it is empty; QualError when it is not a qual history."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        return None
    if "meta" not in tables or "runs" not in tables:
        raise QualError(f"{path} is not a qual history database (no meta/runs tables)")
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    try:
        version = int(row[0])
    except (TypeError, ValueError):
        raise QualError(f"{path}: history database has no valid schema_version") from None
    if version > SCHEMA_VERSION:
        raise QualError(
            f"{path}: history schema v{version} is newer than this qual understands (v{SCHEMA_VERSION}); upgrade qual"
        )
    return version


def _upgrade(conn: sqlite3.Connection, path: Path, version: int | None) -> None:
    """Create (at v1) and migrate to SCHEMA_VERSION; the caller holds the write transaction."""
    if version is None:
        for statement in filter(str.strip, _SCHEMA_V1.split(";")):
            conn.execute(statement)
        conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        version = 1
    while version < SCHEMA_VERSION:
        step = MIGRATIONS.get(version)
        if step is None:
            raise QualError(f"{path}: no migration from history schema v{version} to v{version + 1}")
        step(conn)
        version += 1
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))


def _ensure_schema(conn: sqlite3.Connection, path: Path) -> None:
    """A current schema, created or migrated in one IMMEDIATE transaction.

    Concurrent first writers to a new database must never see it half-built: the schema is created under
    the write lock, and whoever waited for the lock looks again before creating anything."""
    if _schema_state(conn, path) == SCHEMA_VERSION:
        return
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")  # readers never block the writer, nor it them
            conn.execute("BEGIN IMMEDIATE")
            break
        except sqlite3.OperationalError as exc:  # "database is locked" past the busy timeout
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        _upgrade(conn, path, _schema_state(conn, path))
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:  # a failed COMMIT (disk full) may already have rolled back
        conn.execute("ROLLBACK")


def _read_only(path: Path) -> bool:
    return not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK))


def _connect(path: Path, read_only: bool) -> sqlite3.Connection:
    if read_only:
        # A WAL database on a read-only filesystem opens only as immutable (nothing can write it there).
        return sqlite3.connect(f"{path.resolve().as_uri()}?immutable=1", uri=True, timeout=LOCK_TIMEOUT_S,
                               isolation_level=None)
    # Autocommit: transactions are explicit (BEGIN IMMEDIATE), never begun behind qual's back.
    return sqlite3.connect(path, timeout=LOCK_TIMEOUT_S, isolation_level=None)


class HistoryLocked(QualError):
    """Another process held the history's write lock for the whole wait."""


def _unusable(path: Path) -> str | None:
    """Why path cannot hold a history database (None: it can, or it does not exist yet). Nothing is ever created
    beside a path that is not a plain file (SQLite would put its journal there: /dev/null-journal)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "a link to nothing" if path.is_symlink() else None
    except OSError as exc:  # a loop of links, a component that is not a folder
        return f"unusable ({exc.strerror or exc})"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory; give the database file's path"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a device, a FIFO or a socket); give a database file's path"
    return None


@contextmanager
def _open(db_path: str | Path, create: bool) -> Iterator[sqlite3.Connection]:
    check_path_name(db_path, "--history")
    path = Path(db_path)
    why = _unusable(path)
    if why:
        raise QualError(f"history {path}: {why}")
    if not path.exists():
        if not create:
            raise QualError(f"no run history at {path} (runs are recorded by `qual run --history {path}`)")
        path.parent.mkdir(parents=True, exist_ok=True)
    read_only = not create and _read_only(path)
    try:
        with closing(_connect(path, read_only)) as conn:
            conn.row_factory = sqlite3.Row
            if read_only:
                version = _schema_state(conn, path)
                if version != SCHEMA_VERSION:
                    raise QualError(f"{path}: history schema v{version} needs migrating, and the database is read-only")
            else:
                _ensure_schema(conn, path)
            yield conn
    except sqlite3.DatabaseError as exc:
        raise QualError(f"{path}: cannot use history database ({exc})") from None


def check_history(db_path: str | Path, option: str = "--history") -> None:
    """Before any work: the history can take a row (an existing file is a qual history database we may write;
    a new one can be created). Reads only; a dry run may call it."""
    check_path_name(db_path, option)
    path = Path(db_path)
    why = _unusable(path)
    if why:
        raise QualError(f"{option} {path}: {why}")
    if not path.exists():
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise QualError(f"{option} {path}: cannot create the database there ({parent} is not a writable folder)")
        return
    if _read_only(path):
        raise QualError(f"{option} {path}: the history database is read-only (a run could not be recorded)")
    try:  # immutable: reads the file as it is, taking no lock and leaving no -wal/-shm file behind
        with closing(_connect(path, read_only=True)) as conn:
            _schema_state(conn, path)
            damage = conn.execute("PRAGMA quick_check").fetchone()[0]  # a damaged page, found before any arm runs
            if damage != "ok":
                raise QualError(f"{option} {path}: the history database is damaged ({damage})")
    except sqlite3.DatabaseError as exc:
        raise QualError(f"{option} {path}: not a usable history database ({exc})") from None


# ---------------------------------------------------------------- writing and reading


def record_run(db_path: str | Path, result: Result, result_path: str | Path | None, run_id: str | None = None,
               on_wait: Callable[[str], None] | None = None) -> int:
    """Append a completed run; returns its row id. A run_id already recorded adds nothing (the row it has).

    A database another process is writing is waited for (on_wait hears of it once), up to LOCK_TIMEOUT_S; then
    HistoryLocked."""
    k = result.candidate.config
    cmp = result.comparison
    ci = cmp.delta_rate_ci95 or [None, None]
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
        "verdict": result.verdict,
        "failed_checks": json.dumps([c.name for c in result.gate.failed]),
        "result_path": str(result_path) if result_path is not None else None,
        "config_json": json.dumps({"control": result.control.config, "candidate": k}, sort_keys=True),
        "run_id": run_id,
        "configuration": configuration_of(result).key(),
        "baseline": result.baseline.label if result.baseline is not None else None,
        "qual_commit": result.candidate.provenance.qual_commit if result.candidate.provenance is not None else None,
    }
    cols = ", ".join(values)
    marks = ", ".join(f":{c}" for c in values)
    with _open(db_path, create=True) as conn:
        _begin_write(conn, Path(db_path), on_wait)
        try:
            row = conn.execute("SELECT id FROM runs WHERE run_id = ?", (run_id,)).fetchone() if run_id else None
            row_id = row[0] if row else conn.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", values).lastrowid
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise
        return int(row_id)


def _begin_write(conn: sqlite3.Connection, path: Path, on_wait: Callable[[str], None] | None) -> None:
    """BEGIN IMMEDIATE: at once if nobody writes, else after saying so, within LOCK_TIMEOUT_S."""
    conn.execute("PRAGMA busy_timeout = 200")
    try:
        conn.execute("BEGIN IMMEDIATE")
        return
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc):
            raise
    if on_wait:
        on_wait(f"history {path} is being written by another process: waiting up to {LOCK_TIMEOUT_S:.0f} s")
    conn.execute(f"PRAGMA busy_timeout = {int(LOCK_TIMEOUT_S * 1000)}")
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            raise HistoryLocked(f"history {path} stayed locked by another process for {LOCK_TIMEOUT_S:.0f} s") from None
        raise


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
    sql = f"SELECT * FROM runs{where} ORDER BY created_at DESC, id DESC"
    if limit is not None:
        sql += " LIMIT ?"
        args.append(int(limit))
    with _open(db_path, create=False) as conn:
        return [HistoryRun.from_row(r, db_path) for r in conn.execute(sql, args)]


def count_runs(db_path: str | Path) -> int:
    """How many runs the history holds (what a listing that matched none is measured against)."""
    with _open(db_path, create=False) as conn:
        return int(conn.execute("SELECT count(*) FROM runs").fetchone()[0])


def get_run(db_path: str | Path, run_id: int) -> HistoryRun:
    """One run by id (QualError if absent)."""
    if not 1 <= run_id <= MAX_RUN_ID:
        raise QualError(f"no run {run_id} in {db_path} (run ids are 1 to {MAX_RUN_ID})")
    with _open(db_path, create=False) as conn:
        row = conn.execute("SELECT * FROM runs WHERE id = ?", (int(run_id),)).fetchone()
    if row is None:
        raise QualError(f"no run {run_id} in {db_path}")
    return HistoryRun.from_row(row, db_path)


def trend(db_path: str | Path, model: str | None = None, **filters: Any) -> dict[str, list[HistoryRun]]:
    """Runs grouped by series (their configuration key's label), oldest first within each."""
    return group_series(list_runs(db_path, model=model, limit=None, **filters))


def group_series(runs: Sequence[HistoryRun]) -> dict[str, list[HistoryRun]]:
    """Runs by configuration key, oldest first within each, under the key's label."""
    by_key: dict[str, list[HistoryRun]] = {}
    for run in sorted(runs, key=lambda r: (r.created_at, r.id)):
        by_key.setdefault(run.configuration or run.series, []).append(run)
    labels = [rows[0].series for rows in by_key.values()]
    # A label leaves some fields out (the seed where it is 0...): keys that share one are told apart by their hash.
    return {(label if labels.count(label) == 1 else f"{label} #{_key_hash(key)}"): rows
            for label, (key, rows) in zip(labels, by_key.items())}


def _key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:8]


# ---------------------------------------------------------------- step changes


@dataclass(frozen=True)
class StepChange:
    """A jump in one arm's acceptance between consecutive runs of one series."""

    series: str
    arm: str  # control | candidate
    previous_run_id: int
    run_id: int
    created_at: str
    before: float
    after: float
    notes: list[str] = field(default_factory=list)

    @property
    def delta(self) -> float:
        return self.after - self.before

    def describe(self) -> str:
        note = f" ({'; '.join(self.notes)})" if self.notes else ""
        return (
            f"{self.series}: {self.arm} {self.before * 100:.2f}% -> {self.after * 100:.2f}% "
            f"({self.delta * 100:+.2f} pp) between run {self.previous_run_id} and run {self.run_id}{note}"
        )


def detect_step_changes(runs: Sequence[HistoryRun], threshold_pp: float = DEFAULT_STEP_PP) -> list[StepChange]:
    """Flag |change| > threshold_pp in either arm's rate between consecutive runs of the same series."""
    steps = []
    for series, rows in group_series(runs).items():
        for prev, cur in zip(rows, rows[1:]):
            notes = []
            if prev.corpus_fingerprint != cur.corpus_fingerprint:
                notes.append("corpus fingerprint changed")
            if prev.engine_version != cur.engine_version:
                notes.append(f"engine version {prev.engine_version} -> {cur.engine_version}")
            for arm in ("control", "candidate"):
                before, after = getattr(prev, f"{arm}_rate"), getattr(cur, f"{arm}_rate")
                if before is None or after is None:
                    continue
                if abs(after - before) * 100 > threshold_pp:
                    steps.append(StepChange(series, arm, prev.id, cur.id, cur.created_at, before, after, list(notes)))
    return steps


# ---------------------------------------------------------------- baselines


def configuration_of(result: Result) -> ConfigurationKey:
    """The configuration key a result belongs to (qual.configuration)."""
    return ConfigurationKey.of_result(result)


def configuration_runs(db_path: str | Path, configuration: ConfigurationKey, limit: int | None = None) -> list[HistoryRun]:
    """Runs of one configuration, newest first."""
    sql = "SELECT * FROM runs WHERE configuration = ? ORDER BY created_at DESC, id DESC"
    args: list = [configuration.key()]
    if limit is not None:
        sql += " LIMIT ?"
        args.append(int(limit))
    with _open(db_path, create=False) as conn:
        return [HistoryRun.from_row(r, db_path) for r in conn.execute(sql, args)]


def last_pass(db_path: str | Path, configuration: ConfigurationKey) -> HistoryRun | None:
    """The newest run of this configuration whose gate passed."""
    with _open(db_path, create=False) as conn:
        row = conn.execute(
            "SELECT * FROM runs WHERE configuration = ? AND verdict = 'pass' ORDER BY created_at DESC, id DESC LIMIT 1",
            (configuration.key(),),
        ).fetchone()
    return HistoryRun.from_row(row, db_path) if row is not None else None


def nearest_pass(db_path: str | Path, configuration: ConfigurationKey) -> HistoryRun | None:
    """The passing run of the same model whose configuration differs from this one in the fewest fields (the
    newest of those): what `--baseline-any` compares with, and what a refusal names."""
    with _open(db_path, create=False) as conn:
        rows = [HistoryRun.from_row(r, db_path) for r in conn.execute(
            "SELECT * FROM runs WHERE model = ? AND verdict = 'pass' AND configuration IS NOT NULL "
            "ORDER BY created_at DESC, id DESC", (configuration.model,))]
    if not rows:
        return None
    return min(rows, key=lambda r: len(configuration.differences(r.key)))  # min keeps the first (newest) of a tie


def pinned_run(db_path: str | Path, configuration: ConfigurationKey) -> HistoryRun | None:
    """The run pinned as this configuration's baseline, if one is."""
    with _open(db_path, create=False) as conn:
        row = conn.execute(
            "SELECT runs.* FROM pins JOIN runs ON runs.id = pins.run_id WHERE pins.configuration = ?",
            (configuration.key(),),
        ).fetchone()
    return HistoryRun.from_row(row, db_path) if row is not None else None


def baseline_result_paths(db_path: str | Path) -> list[str]:
    """The result files a baseline may still be read from: each pinned run's, and each configuration's newest passing
    run's (what `history:last-pass` picks, and `--baseline-any` nearest among). Paths as recorded, sorted."""
    with _open(db_path, create=False) as conn:
        rows = conn.execute(
            "SELECT result_path FROM runs WHERE id IN (SELECT run_id FROM pins) UNION "
            "SELECT (SELECT result_path FROM runs AS r WHERE r.configuration = c.configuration AND r.verdict = 'pass' "
            "ORDER BY r.created_at DESC, r.id DESC LIMIT 1) FROM (SELECT DISTINCT configuration FROM runs) AS c"
        ).fetchall()
    return sorted({p for (p,) in rows if p})


def pin(db_path: str | Path, run_id: int, pinned_at: str) -> tuple[HistoryRun, int | None]:
    """Make run_id the baseline of its configuration; returns the run and the run it replaces (if any)."""
    run = get_run(db_path, run_id)
    if run.configuration is None:
        raise QualError(f"run {run_id}: its recorded config names no candidate arm, so it has no configuration to pin")
    with _open(db_path, create=False) as conn, conn:
        old = conn.execute("SELECT run_id FROM pins WHERE configuration = ?", (run.configuration,)).fetchone()
        conn.execute("INSERT OR REPLACE INTO pins (configuration, run_id, pinned_at) VALUES (?, ?, ?)",
                     (run.configuration, run.id, pinned_at))
    previous = int(old[0]) if old is not None else None
    return run, previous if previous != run.id else None


def unpin(db_path: str | Path, run_id: int) -> HistoryRun:
    """Remove run_id's pin (QualError if it is not pinned): its configuration falls back to its last pass."""
    run = get_run(db_path, run_id)
    with _open(db_path, create=False) as conn, conn:
        gone = conn.execute("DELETE FROM pins WHERE run_id = ?", (run.id,)).rowcount
    if not gone:
        raise QualError(f"run {run_id} is not pinned (`qual history baseline list` shows the pins)")
    return run


def list_pins(db_path: str | Path) -> list[tuple[HistoryRun, str]]:
    """Every pinned run and when it was pinned, newest pin first."""
    with _open(db_path, create=False) as conn:
        rows = conn.execute(
            "SELECT runs.*, pins.pinned_at AS pinned_at FROM pins JOIN runs ON runs.id = pins.run_id "
            "ORDER BY pins.pinned_at DESC, runs.id DESC"
        ).fetchall()
    return [(HistoryRun.from_row(r, db_path), r["pinned_at"]) for r in rows]
