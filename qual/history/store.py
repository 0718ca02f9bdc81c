"""The history database: where it may live, its connection, its schema and its migrations, the write lock.

A new database is created at schema v1 and migrated in the same transaction (one spelling of the schema); an older
one is migrated when qual first opens it to write. Its rows are keyed by the configuration key of their time: when
the key's fields change (qual.configuration), every row is keyed again from the key it stored, and pins whose series
became one keep the newest (the migration says so in one line on stderr).
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import sys
import time
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Callable, Iterator

from qual.configuration import ConfigurationKey, dcp_comm_of, field_names
from qual.errors import QualError
from qual.userfiles import check_path_name, load_json

SCHEMA_VERSION = 6
LOCK_TIMEOUT_S = 30.0  # how long a writer waits for another process's transaction
MAX_RUN_ID = 2**63 - 1  # SQLite's largest INTEGER PRIMARY KEY: a larger id names no run (and cannot be bound)
KEY_FIELDS = "key_fields"  # meta: the configuration key's fields the rows are keyed by
# Pins newest first by the order they were made, as nights go by their id (runs.newest_first), never by pinned_at: a
# clock set back would reorder them. A pin is a new row (pinning again replaces the row), and SQLite gives a new row
# a rowid above every row there: the rowid is the order of pinning; rekey keeps each pin's.
NEWEST_PIN_FIRST = "ORDER BY pins.rowid DESC"

SCHEMA_V1 = """
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


def configuration_of_row(config_json: str, corpus_fingerprint: str, n_requests: int) -> str | None:
    """The configuration key of a row recorded before its key was (checkpoint identities unknown: qual recorded none
    then). None for a row whose stored config names no candidate arm: it stays listed but never serves as a baseline
    (a migration that stopped on one odd row would lock the whole history)."""
    try:
        candidate = load_json(config_json, "config_json")["candidate"]
        return ConfigurationKey.of(candidate, corpus_fingerprint, n_requests, None).key()
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
    _key_from_configs(conn)


def _key_from_configs(conn: sqlite3.Connection) -> None:
    """Every row's configuration key computed from its stored config, and each pin moved to its run's new key."""
    rows = conn.execute("SELECT id, config_json, corpus_fingerprint, n_requests FROM runs").fetchall()
    for run_id, config_json, fingerprint, n in rows:
        conn.execute("UPDATE runs SET configuration = ? WHERE id = ?", (configuration_of_row(config_json, fingerprint, n),
                                                                        run_id))
    conn.execute("DELETE FROM pins WHERE run_id NOT IN (SELECT id FROM runs WHERE configuration IS NOT NULL)")
    conn.execute("UPDATE pins SET configuration = (SELECT configuration FROM runs WHERE runs.id = pins.run_id)")


def _migrate_v3_to_v4(conn: sqlite3.Connection) -> None:
    """The configuration key gained the checkpoints' identities, the interleave, draft-KV and sparse top-k modes;
    rows get the qual commit that produced them."""
    conn.execute("ALTER TABLE runs ADD COLUMN qual_commit TEXT")
    _key_from_configs(conn)


def _migrate_v4_to_v5(conn: sqlite3.Connection) -> None:
    """The configuration key gains the DCP merge path (dcp_comm), read from each row's stored candidate config; the
    rest of each key stays as recorded (a recomputation would lose the checkpoints' identities)."""
    rows = conn.execute("SELECT id, config_json, configuration FROM runs WHERE configuration IS NOT NULL").fetchall()
    for run_id, config_json, configuration in rows:
        try:
            key = load_json(configuration, "configuration")
            key["dcp_comm"] = dcp_comm_of(load_json(config_json, "config_json")["candidate"])
            new = ConfigurationKey.from_key(json.dumps(key)).key()
        except (QualError, ValueError, KeyError, TypeError, AttributeError):
            new = None  # as configuration_of_row: listed, never a baseline
        conn.execute("UPDATE runs SET configuration = ? WHERE id = ?", (new, run_id))
    conn.execute("DELETE FROM pins WHERE run_id NOT IN (SELECT id FROM runs WHERE configuration IS NOT NULL)")
    # The pins follow their runs when `_upgrade` keys the rows again (rekey): keys that became one there keep one pin


_V6_COLUMNS = ("outcome TEXT", "exit_code INTEGER", "error TEXT", "command TEXT", "run_dir TEXT", "meta TEXT",
               "facts TEXT")


def _migrate_v5_to_v6(conn: sqlite3.Connection) -> None:
    """Four outcomes (pass, fail, inconclusive, error: `verdict` stays pass exactly where the run exited 0); error
    rows (the exit code, its one-line cause, what ran, the run's folder); each night's --meta and facts (engine,
    torch, qual... as JSON). The key's fields changed too (the engine's version left it): `_upgrade` keys the rows
    again. A column already there is kept (the migration may meet a database it half-made)."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
    for column in _V6_COLUMNS:
        if column.split()[0] not in have:
            conn.execute(f"ALTER TABLE runs ADD COLUMN {column}")
    conn.execute("UPDATE runs SET outcome = verdict WHERE outcome IS NULL")


# version v -> function migrating a v database to v+1 (inside the open transaction). A new database is
# created at v1 and migrated, in the same transaction: one spelling of the schema.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: _migrate_v1_to_v2, 2: _migrate_v2_to_v3,
                                                               3: _migrate_v3_to_v4, 4: _migrate_v4_to_v5,
                                                               5: _migrate_v5_to_v6}


def rekey(conn: sqlite3.Connection) -> list[str]:
    """Every row keyed by today's configuration key, from the key it stored (a row without one: from its stored
    config), and the pins of series that became one merged: the pin made last wins (NEWEST_PIN_FIRST). Returns what the merge dropped, one
    phrase per series. A stored key that cannot be read is left as it is (reading that row names it)."""
    for run_id, stored, config_json, fingerprint, n in conn.execute(
            "SELECT id, configuration, config_json, corpus_fingerprint, n_requests FROM runs").fetchall():
        if stored is None:
            key = configuration_of_row(config_json, fingerprint, n)
        else:
            try:
                key = ConfigurationKey.from_key(stored).key()
            except (TypeError, ValueError):
                continue
        if key != stored:
            conn.execute("UPDATE runs SET configuration = ? WHERE id = ?", (key, run_id))
    pins = conn.execute("SELECT runs.configuration, pins.run_id, pins.pinned_at, pins.rowid FROM pins "
                        f"JOIN runs ON runs.id = pins.run_id {NEWEST_PIN_FIRST}").fetchall()
    kept: dict[str, tuple[int, str, int]] = {}
    dropped: dict[str, list[int]] = {}
    for key, run_id, pinned_at, order in pins:
        if key is None:
            continue
        if key in kept:
            dropped.setdefault(key, []).append(run_id)
        else:
            kept[key] = (run_id, pinned_at, order)
    conn.execute("DELETE FROM pins")
    conn.executemany("INSERT INTO pins (rowid, configuration, run_id, pinned_at) VALUES (?, ?, ?, ?)",
                     [(order, key, run_id, at) for key, (run_id, at, order) in kept.items()])
    return [f"run {kept[key][0]} (pinned last) stays the baseline, run{'s' if len(ids) > 1 else ''} "
            f"{', '.join(map(str, ids))} unpinned" for key, ids in dropped.items()]


# ---------------------------------------------------------------- connection and schema


def schema_state(conn: sqlite3.Connection, path: Path) -> int | None:
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


def _keyed_now(conn: sqlite3.Connection) -> bool:
    """The rows are keyed by today's configuration key's fields."""
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (KEY_FIELDS,)).fetchone()
    return row is not None and row[0] == ",".join(field_names())


def _current(conn: sqlite3.Connection, path: Path) -> bool:
    return schema_state(conn, path) == SCHEMA_VERSION and _keyed_now(conn)


def _upgrade(conn: sqlite3.Connection, path: Path, version: int | None) -> list[str]:
    """Create (at v1), migrate to SCHEMA_VERSION and key the rows by today's key; the caller holds the write
    transaction. Returns what keying again merged (qual.history.store.rekey)."""
    if version is None:
        for statement in filter(str.strip, SCHEMA_V1.split(";")):
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
    if _keyed_now(conn):
        return []
    merged = rekey(conn)
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (KEY_FIELDS, ",".join(field_names())))
    return merged


def _ensure_schema(conn: sqlite3.Connection, path: Path) -> None:
    """A current schema, created or migrated in one IMMEDIATE transaction.

    Concurrent first writers to a new database must never see it half-built: the schema is created under
    the write lock, and whoever waited for the lock looks again before creating anything."""
    if _current(conn, path):
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
        merged = _upgrade(conn, path, schema_state(conn, path))
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    if merged:
        sys.stderr.write(f"note: history {path}: series that the configuration key now joins held more than one pin: "
                         f"{'; '.join(merged)}\n")


def rollback(conn: sqlite3.Connection) -> None:
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
def open_history(db_path: str | Path, create: bool) -> Iterator[sqlite3.Connection]:
    """A connection to a current history (created where create, else QualError when there is none); rows come as
    sqlite3.Row. A read-only database is read as it is, if it needs no migration."""
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
                version = schema_state(conn, path)
                if version != SCHEMA_VERSION or not _keyed_now(conn):
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
            schema_state(conn, path)
            damage = conn.execute("PRAGMA quick_check").fetchone()[0]  # a damaged page, found before any arm runs
            if damage != "ok":
                raise QualError(f"{option} {path}: the history database is damaged ({damage})")
    except sqlite3.DatabaseError as exc:
        raise QualError(f"{option} {path}: not a usable history database ({exc})") from None


def begin_write(conn: sqlite3.Connection, path: Path, on_wait: Callable[[str], None] | None, wait_s: float) -> None:
    """BEGIN IMMEDIATE: at once if nobody writes, else after saying so, within wait_s."""
    conn.execute("PRAGMA busy_timeout = 200")
    try:
        conn.execute("BEGIN IMMEDIATE")
        return
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc):
            raise
    if on_wait:
        on_wait(f"history {path} is being written by another process: waiting up to {wait_s:.0f} s")
    conn.execute(f"PRAGMA busy_timeout = {int(wait_s * 1000)}")
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            raise HistoryLocked(f"history {path} stayed locked by another process for {wait_s:.0f} s") from None
        raise
