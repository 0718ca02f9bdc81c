"""SQLite run history, step-change detection and the `qual history` commands (qual.history, qual.cli.history)."""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from qual import history
from qual.history import store
from qual.configuration import NO_IDENTITY
from qual.errors import QualError
from synthetic import synthetic_result


def _night(day: int, p_candidate: float = 0.75, draft_kv: str = "replicated"):
    return synthetic_result(40, 0.75, p_candidate, draft_kv=draft_kv, n_resamples=100,
                            created_at=f"2026-12-{day:02d}T02:00:00+00:00")


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "reports" / "history.sqlite"
    for day, p in ((1, 0.75), (2, 0.75), (3, 0.68), (4, 0.75)):
        history.record_run(path, _night(day, p), f"reports/night{day}/result.json")
    history.record_run(path, _night(5, 0.68, "sharded"), "reports/sharded/result.json")
    return path


def test_record_and_read_back(db):
    runs = history.list_runs(db)
    assert [r.id for r in runs] == [5, 4, 3, 2, 1]  # newest first
    r3 = history.get_run(db, 3)
    assert (r3.model, r3.engine, r3.dcp, r3.tp, r3.draft_kv, r3.verdict) == ("toy", "reference", 4, 4, "replicated", "fail")
    assert r3.failed_checks == ["acceptance_delta_lower_bound", "mean_acceptance_length_ratio"]
    assert r3.corpus_fingerprint.startswith("sha256:") and r3.result_path == "reports/night3/result.json"
    assert r3.ci_lo <= r3.delta_rate <= r3.ci_hi < 0
    assert r3.config["control"]["dcp"] == 1 and r3.config["candidate"]["dcp"] == 4
    assert r3.engine_version == "qual-reference 0.1.0"
    assert [r.id for r in history.list_runs(db, draft_kv="sharded")] == [5]
    assert history.list_runs(db, model="other") == []
    assert len(history.list_runs(db, limit=2)) == 2


def test_missing_things_are_user_errors(db, tmp_path):
    with pytest.raises(QualError, match="no run 99"):
        history.get_run(db, 99)
    missing = tmp_path / "nope.sqlite"
    with pytest.raises(QualError, match="no run history at"):
        history.list_runs(missing)
    assert not missing.exists()  # reading never creates a database
    with pytest.raises(QualError, match="unknown history filter"):
        history.list_runs(db, colour="red")


def test_schema_version_is_checked(tmp_path, db):
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    conn.close()
    with pytest.raises(QualError, match="schema v7 is newer"):
        history.list_runs(db)
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    with pytest.raises(QualError, match="not a qual history database"):
        history.list_runs(other)
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(QualError, match="cannot use history database"):
        history.record_run(garbage, _night(1), None)


def test_older_schema_is_migrated(tmp_path, db, monkeypatch):
    def add_notes(conn):
        conn.execute("ALTER TABLE runs ADD COLUMN notes TEXT")

    v = store.SCHEMA_VERSION
    monkeypatch.setattr(store, "SCHEMA_VERSION", v + 1)
    monkeypatch.setitem(store.MIGRATIONS, v, add_notes)
    assert len(history.list_runs(db)) == 5
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT value FROM meta").fetchone()[0] == str(v + 1)
        assert "notes" in [r[1] for r in conn.execute("PRAGMA table_info(runs)")]
    conn.close()
    monkeypatch.setattr(store, "SCHEMA_VERSION", v + 2)
    with pytest.raises(QualError, match=f"no migration from history schema v{v + 1}"):
        history.list_runs(db)


def test_trend_groups_series_and_detects_steps(db):
    series = history.trend(db, model="toy")
    assert sorted(len(v) for v in series.values()) == [1, 4]  # replicated nightly series, one sharded run
    nightly = next(v for v in series.values() if len(v) == 4)
    assert [r.id for r in nightly] == [1, 2, 3, 4]  # oldest first
    steps = history.detect_step_changes([r for v in series.values() for r in v])
    assert [(s.arm, s.previous_run_id, s.run_id) for s in steps] == [("candidate", 2, 3), ("candidate", 3, 4)]
    assert steps[0].delta < -0.02 and "between run 2 and run 3" in steps[0].describe()
    # The sharded run is its own series: no step against the replicated runs.
    assert all(s.run_id != 5 for s in steps)
    assert history.detect_step_changes(nightly, threshold_pp=50.0) == []


def test_a_series_is_one_configuration_key(db):
    """Runs of another request count (--limit) or draft-KV layout are other series: no step between them."""
    history.record_run(db, synthetic_result(16, 0.75, 0.60, n_resamples=100, created_at="2026-12-06T02:00:00+00:00"),
                       "reports/small/result.json")
    series = history.trend(db, model="toy")
    assert sorted(len(v) for v in series.values()) == [1, 1, 4]
    assert {r.n_requests for v in series.values() for r in v if len(v) == 1} == {16, 40}
    assert all(s.run_id not in (5, 6) for s in history.detect_step_changes([r for v in series.values() for r in v]))
    labels = sorted(series)
    assert sum("n=16" in label for label in labels) == 1 and sum("kv=sharded" in label for label in labels) == 1


def test_cli_trend_json_and_fail_on_step(db):
    runner, app = CliRunner(), _cli()
    out = runner.invoke(app, ["history", "trend", "--json", "--history", str(db)])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    nightly = next(s for s in data["series"] if len(s["runs"]) == 4)
    assert nightly["configuration"]["n_requests"] == 40 and nightly["configuration"]["draft_kv"] == "replicated"
    assert [r["id"] for r in nightly["runs"]] == [1, 2, 3, 4]
    assert [(s["previous_run_id"], s["run_id"]) for s in data["steps"]] == [(2, 3), (3, 4)]
    out = runner.invoke(app, ["history", "trend", "--fail-on-step", "--history", str(db)])
    assert out.exit_code == 1 and "2 step change(s)" in out.output
    out = runner.invoke(app, ["history", "trend", "--fail-on-step", "--threshold-pp", "50", "--history", str(db)])
    assert out.exit_code == 0 and "no step changes > 50 pp" in out.output


def test_step_notes_corpus_change(db):
    runs = history.trend(db)
    nightly = next(v for v in runs.values() if len(v) == 4)
    changed = [nightly[1], history.HistoryRun(**{**nightly[2].__dict__, "corpus_fingerprint": "sha256:new"})]
    (step,) = history.detect_step_changes(changed)
    assert "corpus fingerprint changed" in step.notes


def _cli():
    from qual.cli import history as _register  # noqa: F401  (registers `history` on the app)
    from qual.cli.main import app

    return app


def test_cli_list_show_trend(db, tmp_path):
    runner, app = CliRunner(), _cli()
    out = runner.invoke(app, ["history", "list", "--history", str(db)])
    assert out.exit_code == 0, out.output
    assert "FAIL" in out.output and "sharded" in out.output
    head, first = out.output.splitlines()[2], out.output.splitlines()[4]  # title, blank, header, rule, newest run
    assert all(col in head for col in ("engine", "commit", "requests")), out.output
    assert "qual-reference 0.1.0" in first and " 40 " in first, out.output
    out = runner.invoke(app, ["history", "show", "3", "--history", str(db)])
    assert out.exit_code == 0 and "acceptance_delta_lower_bound" in out.output
    plot = tmp_path / "trend.svg"
    out = runner.invoke(app, ["history", "trend", "--model", "toy", "--out", str(plot), "--history", str(db)])
    assert out.exit_code == 0, out.output
    assert "2 step change(s)" in out.output and "between run 2 and run 3" in out.output
    assert plot.read_text().lstrip().startswith("<?xml")
    out = runner.invoke(app, ["history", "trend", "--out", str(tmp_path / "t.gif"), "--history", str(db)])
    assert isinstance(out.exception, QualError)
    out = runner.invoke(app, ["history", "show", "42", "--history", str(db)])
    assert isinstance(out.exception, QualError)


WRITER = """
import sys, time
from pathlib import Path
from qual import history
from synthetic import synthetic_result
root, rows, trials = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
result = synthetic_result(4, n_resamples=10)
for t in range(trials):
    (root / f"ready-{t}-{sys.argv[4]}").touch()
    while not (root / f"go-{t}").exists():  # every writer starts at once, on a database that does not exist yet
        time.sleep(0)
    for _ in range(rows):
        history.record_run(root / f"fresh-{t}.sqlite", result, None)
"""


def test_concurrent_first_writers_lose_no_row(tmp_path):
    """4 processes x 20 rows into each of 5 fresh databases: every database holds all 80."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    writers, rows, trials = 4, 20, 5
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(rows), str(trials), str(w)], env=env,
                              stderr=subprocess.PIPE, text=True) for w in range(writers)]
    for t in range(trials):
        deadline = time.time() + 120
        while time.time() < deadline and not all((tmp_path / f"ready-{t}-{w}").exists() for w in range(writers)):
            if any(p.poll() is not None for p in procs):
                break  # a writer died: its error is reported below
            time.sleep(0.01)
        (tmp_path / f"go-{t}").touch()
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * writers, errors
    assert [len(history.list_runs(tmp_path / f"fresh-{t}.sqlite", limit=None)) for t in range(trials)] == [80] * trials


def test_rich_markup_in_user_text_is_printed_literally(tmp_path):
    path = tmp_path / "h.sqlite"
    night = _night(1)
    for arm in (night.control, night.candidate):
        arm.config["model"] = "evil[/]model[bold]"
    history.record_run(path, night, "reports/[red]x[/red]/result.json")
    runner, app = CliRunner(), _cli()
    for argv in (["list"], ["show", "1"], ["trend"]):
        out = runner.invoke(app, ["history", *argv, "--history", str(path)])
        assert out.exit_code == 0, (argv, out.output, out.exception)
        assert "evil[/]model[bold]" in out.output, (argv, out.output)


def test_a_run_id_is_recorded_once_and_a_v1_database_is_migrated(tmp_path):
    path = tmp_path / "v1.sqlite"
    with sqlite3.connect(path) as conn:  # a database as a qual of schema v1 left it, with one run
        conn.executescript(store.SCHEMA_V1)
        conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        conn.execute("INSERT INTO runs (created_at, model, engine, dcp, tp, draft_kv, config_key, corpus_name, "
                     "corpus_fingerprint, n_requests, verdict, failed_checks, config_json) "
                     "VALUES ('2026-11-30', 'toy', 'reference', 4, 4, 'replicated', 'k', 'c', 'sha256:0', 1, 'pass', "
                     "'[]', '{}')")
    conn.close()
    first = history.record_run(path, _night(2), "a/result.json", run_id="run-a")
    assert history.record_run(path, _night(2), "a/result.json", run_id="run-a") == first  # a resumed run
    history.record_run(path, _night(3), "b/result.json", run_id="run-b")
    assert [(r.id, r.run_id) for r in history.list_runs(path)] == [(3, "run-b"), (2, "run-a"), (1, None)]


# ---------------------------------------------------------------- baselines (schema v3)

_V1_COLUMNS = ", ".join(c for c in history.COLUMNS[:history.COLUMNS.index("run_id")])


def test_a_v1_history_is_migrated_and_its_runs_can_be_baselines(db, tmp_path):
    """A database written before baselines existed: each run gets its configuration from its stored config."""
    old = tmp_path / "v1.sqlite"
    with sqlite3.connect(old) as conn:
        conn.executescript(store.SCHEMA_V1)
        conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        conn.execute("ATTACH DATABASE ? AS cur", (str(db),))
        conn.execute(f"INSERT INTO runs ({_V1_COLUMNS}) SELECT {_V1_COLUMNS} FROM cur.runs")
    conn.close()
    runs = history.list_runs(old)
    assert [r.id for r in runs] == [5, 4, 3, 2, 1]
    # the same keys, but for the checkpoints' identities: a run recorded before qual kept them has none
    unknown = dict(target=NO_IDENTITY, draft=NO_IDENTITY)
    assert [r.key for r in runs] == [replace(r.key, **unknown) for r in history.list_runs(db)]
    night = replace(history.configuration_of(_night(4)), **unknown)
    assert history.last_pass(old, night).id == 4  # nights 3 and 5 (sharded draft KV) failed
    assert history.pin(old, 2, "2026-12-06T00:00:00+00:00")[0].id == 2
    with sqlite3.connect(old) as conn:
        assert conn.execute("SELECT value FROM meta").fetchone()[0] == str(history.SCHEMA_VERSION) == "6"
    conn.close()


def test_a_v3_history_keeps_its_pins_under_the_new_key(tmp_path):
    """v3 keyed configurations without the engine version, checkpoints, interleave or modes: v4 recomputes every
    row's key and moves each pin to its run's new key."""
    path = tmp_path / "v3.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(store.SCHEMA_V1)
        conn.execute("INSERT INTO meta VALUES ('schema_version', '3')")
        store._migrate_v1_to_v2(conn)
        store._migrate_v2_to_v3(conn)
        conn.execute("UPDATE meta SET value = '3'")
    conn.close()
    # a v3 row: the columns v3 had, its configuration as v3 spelled it, and a pin on it
    night = _night(2)
    with sqlite3.connect(path) as conn:
        conn.execute(
            "INSERT INTO runs (created_at, model, engine, engine_version, dcp, tp, draft_kv, config_key, corpus_name, "
            "corpus_fingerprint, n_requests, verdict, failed_checks, config_json, configuration) VALUES "
            "(?, 'toy', 'reference', 'qual-reference 0.1.0', 4, 4, 'replicated', 'k', 'c', ?, 40, 'pass', '[]', ?, "
            "'{\"v3\": 1}')",
            (night.created_at, night.corpus.fingerprint,
             json.dumps({"control": night.control.config, "candidate": night.candidate.config})))
        conn.execute("INSERT INTO pins VALUES ('{\"v3\": 1}', 1, '2026-12-03T00:00:00+00:00')")
    conn.close()
    key = replace(history.configuration_of(night), target=NO_IDENTITY, draft=NO_IDENTITY)
    assert history.get_run(path, 1).key == key
    assert history.pinned_run(path, key).id == 1


def test_a_v4_history_keys_gain_the_dcp_merge_path_and_keep_the_rest(tmp_path):
    """v4 keyed configurations without the DCP merge path: v5 reads it from each row's stored candidate config and
    keeps the rest of the key as recorded (the checkpoints' identities, which a recomputation would lose), and pins
    follow their runs."""
    path = tmp_path / "v4.sqlite"
    night = synthetic_result(40, 0.75, 0.75, n_resamples=100, extra={"reference": {"dcp_comm": "invariant"}})
    history.record_run(path, night, "a/result.json")
    key = replace(history.configuration_of(night), target="sha256:" + "1" * 64)
    assert key.dcp_comm == "invariant" and "merge=invariant" in key.label()
    v4 = {k: v for k, v in json.loads(key.key()).items() if k != "dcp_comm"}
    with sqlite3.connect(path) as conn:  # the row and a pin on it as a v4 qual left them
        conn.execute("UPDATE runs SET configuration = ?", (json.dumps(v4),))
        conn.execute("INSERT INTO pins VALUES (?, 1, '2026-12-03T00:00:00+00:00')", (json.dumps(v4),))
        conn.execute("UPDATE meta SET value = '4'")
    conn.close()
    assert history.get_run(path, 1).key == key
    assert history.pinned_run(path, key).id == 1


def test_the_dcp_merge_path_is_part_of_the_configuration_key():
    """Runs that differ only in how DCP partial attentions merge are different configurations: the reference engine's
    dcp_comm, vLLM's dcp_comm_backend; unknown where the engine section names none (vLLM's own default)."""
    def key(engine, section):
        return history.configuration_of(synthetic_result(40, 0.75, 0.75, n_resamples=100, engine=engine,
                                                         extra={engine: section}))

    a2a, invariant = key("reference", {"dcp_comm": "a2a"}), key("reference", {"dcp_comm": "invariant"})
    assert [d[0] for d in a2a.differences(invariant)] == ["dcp_comm"]
    assert "merge=" not in a2a.label() and "merge=invariant" in invariant.label()
    assert key("vllm", {"dcp_comm_backend": "ag_rs"}).dcp_comm == "ag_rs"
    assert key("vllm", {}).dcp_comm == NO_IDENTITY


def test_a_new_history_is_created_at_the_current_schema(db):
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT value FROM meta").fetchone()[0] == str(history.SCHEMA_VERSION)
        columns = [r[1] for r in conn.execute("PRAGMA table_info(runs)")]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    conn.close()
    assert columns == list(history.COLUMNS) and "pins" in tables
    assert history.get_run(db, 1).configuration == history.configuration_of(_night(1)).key()


def test_cli_pin_needs_the_result_file(db):
    runner, app = CliRunner(), _cli()
    out = runner.invoke(app, ["history", "baseline", "pin", "2", "--history", str(db)])
    assert isinstance(out.exception, QualError) and "its result file reports/night2/result.json is missing" in str(out.exception)
    out = runner.invoke(app, ["history", "baseline", "list", "--history", str(db)])
    assert out.exit_code == 0 and "no pinned runs" in out.output


def test_keys_that_share_a_label_are_two_series(db):
    """The label leaves a seed of 0 out: runs differing only in the seed are two series, told apart by the key hash."""
    from qual.records import Sampling

    for day in (6, 7):
        history.record_run(db, synthetic_result(40, 0.75, 0.75, n_resamples=100, sampling=Sampling(0.0, 5, 64),
                                                created_at=f"2026-12-{day:02d}T02:00:00+00:00"), None)
    series = history.trend(db, model="toy")
    assert sorted(len(v) for v in series.values()) == [1, 2, 4]
    steps = history.detect_step_changes([r for v in series.values() for r in v])
    assert all(s.series in series for s in steps) and all(s.run_id not in (6, 7) for s in steps)


def test_cli_filters_that_match_no_run_say_so(db, capsys):
    from cli_inprocess import qual_in

    for filters in (["list", "--model", "bogus"], ["trend", "--dcp", "0"], ["trend", "--draft-kv", "bogus"]):
        proc = qual_in(capsys, "history", *filters, "--history", db)
        assert (proc.returncode, proc.stdout, proc.stderr) == \
            (0, f"no run matches {' '.join(filters[1:])} in {db} (5 runs recorded)\n", ""), filters
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM runs")
    proc = qual_in(capsys, "history", "list", "--model", "bogus", "--history", db)
    assert (proc.returncode, proc.stdout) == (0, f"no runs recorded in {db}\n")


def test_cli_trend_checks_its_plot_path_before_the_trend(db, tmp_path, capsys):
    from cli_inprocess import qual_in

    proc = qual_in(capsys, "history", "trend", "--out", tmp_path / "tr.txt", "--history", db)
    assert (proc.returncode, proc.stdout, proc.stderr) == \
        (2, "", "error: plot output must end in .png or .svg, got 'tr.txt'\n")
    (tmp_path / "a.svg").mkdir()
    proc = qual_in(capsys, "history", "trend", "--out", tmp_path / "a.svg", "--history", db)
    assert (proc.returncode, proc.stdout, proc.stderr) == \
        (2, "", f"error: --out {tmp_path / 'a.svg'}: is a directory; give the plot file's path\n")


@pytest.mark.parametrize("column,value,what", [
    ("config_json", "{not json", "config_json:1: invalid JSON (Expecting property name enclosed in double quotes, "
                                 "column 2)"),
    ("config_json", "[1]", "config_json: expected an object, got list"),
    ("failed_checks", "5", "failed_checks: expected a list of check names, got int"),
])
def test_cli_a_damaged_row_is_one_line_naming_it(db, tmp_path, capsys, column, value, what):
    from cli_inprocess import qual_in

    with sqlite3.connect(db) as conn:
        conn.execute(f"UPDATE runs SET {column} = ? WHERE id = 3", (value,))
    for command in (["list"], ["trend"], ["show", "3"], ["publish", tmp_path / "site"]):
        proc = qual_in(capsys, "history", *command, "--history", db)
        assert (proc.returncode, proc.stderr) == (2, f"error: history {db}: run 3: {what}\n"), command


# ---------------------------------------------------------------- rows typed on read (schema v5)


@pytest.mark.parametrize("column,value,what", [
    ("control_rate", "abc", "control_rate: expected a rate in [0, 1], got 'abc'"),
    ("candidate_rate", -5, "candidate_rate: expected a rate in [0, 1], got -5.0"),
    ("candidate_rate", 1e309, "candidate_rate: expected a rate in [0, 1], got inf"),
    ("configuration", "{}", "configuration: not a configuration key (no 'model')"),
    ("result_path", b"\x00\x01", "result_path: expected text, got a BLOB of 2 bytes"),
    ("n_requests", 2.5, "n_requests: expected an integer >= 0, got 2.5"),
    ("outcome", "maybe", "outcome: expected one of pass, fail, inconclusive, error, got 'maybe'"),
    ("meta", '{"k": 1}', "meta: expected an object of texts, got dict"),
])
def test_a_damaged_row_is_exit_2_naming_row_and_column_everywhere_it_is_read(db, tmp_path, capsys, column, value,
                                                                             what):
    """Issue 55, bug 10: list, show, trend and publish exited 4 on these; and so does a baseline's resolution."""
    from cli_inprocess import qual_in
    from qual.harness.baseline import LAST_PASS, resolve

    with sqlite3.connect(db) as conn:
        conn.execute(f"UPDATE runs SET {column} = ? WHERE id = 3", (value,))
    conn.close()
    for command in (["list"], ["trend"], ["show", "3"], ["publish", tmp_path / "site"], ["list", "--json"],
                    ["trend", "--json"]):
        proc = qual_in(capsys, "history", *command, "--history", db)
        assert (proc.returncode, proc.stderr) == (2, f"error: history {db}: run 3: {what}\n"), command
    if column == "outcome":
        return  # a row whose outcome is damaged is no pass: no baseline reads it
    with sqlite3.connect(db) as conn:  # the same damage in a pass, which a baseline's resolution reads
        conn.execute(f"UPDATE runs SET {column} = ? WHERE id = 4", (value,))
    conn.close()
    with pytest.raises(QualError, match=rf"run 4: {re.escape(what)}"):
        resolve(LAST_PASS, db, replace(history.configuration_of(_night(1)), device="cuda"), any_key=True)


def test_an_error_row_is_listed_never_a_baseline_and_its_run_replaces_it(tmp_path):
    """A night without a verdict is recorded (outcome error, the exit code and its cause) and shown; it is never a
    last pass; the same run finished later (--resume) replaces it under its id; a run recorded with a verdict is never
    replaced by an error row."""
    path = tmp_path / "h.sqlite"
    night = _night(2)
    key = history.configuration_of(night)
    first = history.record_run(path, _night(1), "a/result.json", run_id="run-a")
    error = history.ErrorNight(created_at="2026-12-02T02:00:00+00:00", run_id="run-b",
                               arms={"control": night.control.config, "candidate": night.candidate.config},
                               corpus={"name": "synthetic", "fingerprint": night.corpus.fingerprint, "count": 40},
                               key=key, exit_code=3, cause="engine failure: the server went away",
                               command="qual run --dcp 4", run_dir=str(tmp_path / "b"), meta={"ci_run": "7"})
    row = history.record_error(path, error)
    got = history.get_run(path, row)
    assert (got.outcome, got.verdict, got.exit_code, got.error, got.control_rate) == (
        "error", "fail", 3, "engine failure: the server went away", None)
    assert got.meta == {"ci_run": "7"} and got.key == key and got.series == history.get_run(path, first).series
    assert history.last_pass(path, key).id == first
    assert history.detect_step_changes(history.list_runs(path)) == []  # an error night measured nothing
    assert history.record_error(path, error) == row  # a resume that failed again: the same row
    assert history.record_run(path, night, "b/result.json", run_id="run-b") == row  # the finished run, in its place
    replaced = history.get_run(path, row)
    assert (replaced.outcome, replaced.exit_code, replaced.error, replaced.result_path) == ("pass", 0, None, "b/result.json")
    assert history.record_error(path, error) == row and history.get_run(path, row).outcome == "pass"  # kept
    assert history.last_pass(path, key).id == row and len(history.list_runs(path)) == 2
    other = history.record_error(path, replace(error, run_id="run-c"))
    with pytest.raises(QualError, match=f"run {other} ended without a verdict"):
        history.pin(path, other, "2026-12-03T00:00:00+00:00")


def test_an_inconclusive_night_is_never_a_series_last_pass(tmp_path):
    """Whatever it exits with: a gate file's `inconclusive: pass` makes it exit 0, and it is still not the level a
    later night is held to."""
    path = tmp_path / "h.sqlite"
    rules = {"inconclusive": "pass", "rules": [{"check": "candidate_runnable"},
                                               {"check": "acceptance_delta_lower_bound", "min_pp": -0.5}]}
    passed = history.record_run(path, _night(1), "a/result.json")
    # 6 requests, one of them a little worse: the interval [-3.6, 0] pp straddles -0.5 pp
    unsure = synthetic_result(6, 0.75, 0.745, n_resamples=200, rules=rules, created_at="2026-12-02T02:00:00+00:00")
    assert (unsure.gate.outcome, unsure.gate.passed) == ("inconclusive", True)
    history.record_run(path, unsure, "b/result.json")
    runs = history.list_runs(path)
    assert [(r.outcome, r.verdict) for r in runs] == [("inconclusive", "pass"), ("pass", "pass")]
    assert "acceptance_delta_lower_bound" in runs[0].failed_checks
    assert history.last_pass(path, history.configuration_of(unsure)) is None  # another selection: 6 requests
    assert history.last_pass(path, history.configuration_of(_night(1))).id == passed


@pytest.mark.parametrize("second_pinned_at", ["2026-12-06T00:00:00+00:00", "2026-12-04T00:00:00+00:00"],
                         ids=["clock-forward", "clock-set-back"])
def test_a_v4_history_is_keyed_again_without_losing_a_row_and_the_newest_pin_wins(tmp_path, capsys, second_pinned_at):
    """v4 keyed series by the engine's version too: two engine versions were two series, each with its own pin. Keyed
    again, they are one series; the pin set last stays, the other goes, and the migration says so in one line. "Last"
    is the order of pinning, whatever the clock said when the second pin was made."""
    path = tmp_path / "v4.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(store.SCHEMA_V1)
        conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        for step in (store._migrate_v1_to_v2, store._migrate_v2_to_v3, store._migrate_v3_to_v4):
            step(conn)
        conn.execute("UPDATE meta SET value = '4'")
        for i, (version, day) in enumerate((("vllm 0.32.0", 1), ("vllm 0.33.0", 2), ("vllm 0.33.0", 3)), start=1):
            night = _night(day)
            old = {**json.loads(history.configuration_of(night).key()), "engine_version": version}
            del old["numerics"], old["dcp_comm"]
            conn.execute(
                "INSERT INTO runs (created_at, model, engine, engine_version, dcp, tp, draft_kv, config_key, "
                "corpus_name, corpus_fingerprint, n_requests, verdict, failed_checks, config_json, configuration, "
                "result_path) VALUES (?, 'toy', 'reference', ?, 4, 4, 'replicated', 'k', 'c', ?, 40, 'pass', '[]', ?, "
                "?, ?)", (night.created_at, version, night.corpus.fingerprint,
                          json.dumps({"control": night.control.config, "candidate": night.candidate.config}),
                          json.dumps(old, sort_keys=True), f"r{i}/result.json"))
        conn.execute("INSERT INTO pins SELECT configuration, 1, '2026-12-05T00:00:00+00:00' FROM runs WHERE id = 1")
        conn.execute("INSERT INTO pins SELECT configuration, 2, ? FROM runs WHERE id = 2", (second_pinned_at,))
    conn.close()
    runs = history.list_runs(path)
    assert [r.id for r in runs] == [3, 2, 1] and len({r.configuration for r in runs}) == 1
    assert [r.outcome for r in runs] == ["pass"] * 3 and [r.facts["engine"] for r in runs] == [
        "vllm 0.33.0", "vllm 0.33.0", "vllm 0.32.0"]
    assert [(r.id, at) for r, at in history.list_pins(path)] == [(2, second_pinned_at)]
    err = capsys.readouterr().err
    assert err == (f"note: history {path}: series that the configuration key now joins held more than one pin: "
                   "run 2 (pinned last) stays the baseline, run 1 unpinned\n")
    history.list_runs(path)
    assert capsys.readouterr().err == ""  # said once, when keyed again
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "6"
    conn.close()


def test_rows_are_keyed_again_when_the_keys_fields_change(db, monkeypatch):
    """Adding a field to the key is one line in qual.configuration: the history keys every row again from the key it
    stored (the new field at its default) the next time qual opens it to write."""
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value = 'model,engine' WHERE key = 'key_fields'")
        stored = json.loads(conn.execute("SELECT configuration FROM runs WHERE id = 1").fetchone()[0])
        del stored["numerics"]
        conn.execute("UPDATE runs SET configuration = ? WHERE id = 1", (json.dumps(stored),))
    conn.close()
    assert history.get_run(db, 1).configuration == history.configuration_of(_night(1)).key()


# ---------------------------------------------------------------- JSON for programs, the axis


def test_cli_json_outputs_name_their_schema(db, capsys):
    from cli_inprocess import qual_in

    listed = json.loads(qual_in(capsys, "history", "list", "--json", "--history", db).stdout)
    assert listed["schema"] == "qual.history.list/1" and [r["id"] for r in listed["runs"]] == [5, 4, 3, 2, 1]
    run = listed["runs"][2]
    assert (run["outcome"], run["failed_checks"], run["configuration"]["draft_kv"]) == (
        "fail", ["acceptance_delta_lower_bound", "mean_acceptance_length_ratio"], "replicated")
    assert run["facts"]["engine"] == "qual-reference 0.1.0" and run["delta_rate_ci95"][0] <= run["delta_rate"]
    shown = json.loads(qual_in(capsys, "history", "show", "3", "--json", "--history", db).stdout)
    assert shown["schema"] == "qual.history.run/1" and shown["run"]["config"]["candidate"]["dcp"] == 4
    assert {k: v for k, v in shown["run"].items() if k != "config"} == run
    trend = json.loads(qual_in(capsys, "history", "trend", "--json", "--axis", "engine", "--history", db).stdout)
    assert (trend["schema"], trend["axis"]) == ("qual.history.trend/1", "engine")
    nightly = next(s for s in trend["series"] if len(s["runs"]) == 4)
    assert [r["x"] for r in nightly["runs"]] == ["qual-reference 0.1.0"] * 4
    assert [r["changed"] for r in nightly["runs"]] == [[]] * 4


def test_trend_plots_along_an_axis_and_marks_engine_changes_and_error_nights(tmp_path, capsys):
    from cli_inprocess import qual_in

    path = tmp_path / "h.sqlite"
    for day in (1, 2, 3):
        night = _night(day)
        night.candidate.engine_version = f"vllm 0.3{day}.0"
        night.meta = {"cluster": "east" if day < 3 else "west"}
        history.record_run(path, night, None)
    trend = json.loads(qual_in(capsys, "history", "trend", "--json", "--axis", "meta:cluster", "--history", path).stdout)
    (series,) = trend["series"]
    assert [r["x"] for r in series["runs"]] == ["east", "east", "west"]
    assert [r["changed"] for r in series["runs"]] == [[], ["engine vllm 0.31.0 -> 0.32.0"],
                                                      ["engine vllm 0.32.0 -> 0.33.0"]]
    plot = tmp_path / "t.svg"
    proc = qual_in(capsys, "history", "trend", "--axis", "engine", "--out", plot, "--history", path)
    assert proc.returncode == 0, proc.stderr
    svg = plot.read_text()
    assert all(f"vllm 0.3{day}.0" in svg for day in (1, 2, 3)) and svg.count("stroke-dasharray") >= 2
    proc = qual_in(capsys, "history", "trend", "--axis", "gpu", "--history", path)
    assert proc.returncode == 2 and "--axis 'gpu': expected one of date, engine, qual or meta:KEY" in proc.stderr


def test_pin_takes_a_run_directory(tmp_path, capsys):
    from cli_inprocess import qual_in
    from qual.result import save_result

    path = tmp_path / "h.sqlite"
    for day in (1, 2):
        saved = save_result(_night(day), tmp_path / f"night{day}" / "result.json")
        history.record_run(path, _night(day), saved)
    proc = qual_in(capsys, "history", "baseline", "pin", tmp_path / "night1", "--history", path)
    assert proc.returncode == 0 and proc.stdout.startswith("run 1 is now the baseline of its configuration"), proc
    proc = qual_in(capsys, "history", "baseline", "pin", tmp_path / "elsewhere", "--history", path)
    assert proc.returncode == 2 and "no run recorded from the folder" in proc.stderr


# ---------------------------------------------------------------- the history for notebooks


def test_load_history_gives_nights_and_series_as_tables(db, tmp_path):
    """`qual.load_history`: a row a night (each value the row's, read typed), a row a series (its nights counted by
    outcome, its latest night, its last pass); pandas loads with the first table, never with `import qual`."""
    import subprocess
    import sys

    import qual

    loaded = qual.load_history(db)
    runs, series = loaded.runs, loaded.series
    recorded = sorted(history.list_runs(db), key=lambda r: (r.created_at, r.id))
    assert list(runs["id"]) == [r.id for r in recorded] == [1, 2, 3, 4, 5]
    assert list(runs["outcome"]) == [r.outcome for r in recorded] == ["pass", "pass", "fail", "pass", "fail"]
    assert list(runs["candidate_rate"]) == [r.candidate_rate for r in recorded]
    assert list(runs["key.draft_kv"]) == [r.key.draft_kv for r in recorded]
    assert list(runs["facts.engine"]) == ["qual-reference 0.1.0"] * 5 and str(runs["created_at"].dt.tz) == "UTC"
    assert runs.loc[2, "failed_checks"] == "acceptance_delta_lower_bound, mean_acceptance_length_ratio"
    groups = history.group_series(recorded)
    assert list(series["series"]) == list(groups) and list(series["nights"]) == [len(g) for g in groups.values()]
    nightly = series[series["nights"] == 4].iloc[0]
    assert (nightly["passes"], nightly["fails"], nightly["latest_id"], nightly["last_pass_id"]) == (3, 1, 4, 4)
    code = "import qual, sys; qual.load_history; print('pandas' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_export_writes_the_tables(db, tmp_path, capsys):
    import pandas as pd

    from cli_inprocess import qual_in

    proc = qual_in(capsys, "history", "export", tmp_path / "out", "--history", db)
    assert proc.returncode == 0, proc.stderr
    runs = pd.read_csv(tmp_path / "out" / "runs.csv")
    assert list(runs["id"]) == [1, 2, 3, 4, 5] and list(runs["outcome"]) == ["pass", "pass", "fail", "pass", "fail"]
    assert list(pd.read_csv(tmp_path / "out" / "series.csv")["nights"]) == [4, 1]
    proc = qual_in(capsys, "history", "export", tmp_path / "out", "--format", "xlsx", "--history", db)
    assert proc.returncode == 2 and "--format 'xlsx': expected csv or parquet" in proc.stderr
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        proc = qual_in(capsys, "history", "export", tmp_path / "pq", "--format", "parquet", "--history", db)
        assert proc.returncode == 2 and "needs pyarrow" in proc.stderr
        return
    proc = qual_in(capsys, "history", "export", tmp_path / "pq", "--format", "parquet", "--history", db)
    assert proc.returncode == 0 and list(pd.read_parquet(tmp_path / "pq" / "runs.parquet")["id"]) == [1, 2, 3, 4, 5]


def test_a_glm_night_recorded_before_numerics_joins_the_exact_series(tmp_path):
    """A GLM night stored before the key had numerics (its stored key without the field) is keyed again as numerics
    "exact", the one form qual computed then: the last pass of a night of today without --numerics, never of one
    run with --numerics vllm (another experiment, no series it may follow)."""
    path = tmp_path / "h.sqlite"
    glm = dict(n_resamples=100, model="glm-toy", dsa_topk="exact")
    before = synthetic_result(40, 0.75, 0.75, created_at="2026-12-01T02:00:00+00:00", **glm)
    history.record_run(path, before, "a/result.json")
    with sqlite3.connect(path) as conn:  # the row as a qual without the field left it
        stored = json.loads(conn.execute("SELECT configuration FROM runs WHERE id = 1").fetchone()[0])
        del stored["numerics"]
        conn.execute("UPDATE runs SET configuration = ? WHERE id = 1", (json.dumps(stored),))
        conn.execute("UPDATE meta SET value = ? WHERE key = ?",
                     (",".join(f for f in stored), store.KEY_FIELDS))
    conn.close()
    exact, vllm = (synthetic_result(40, 0.75, 0.75, created_at=f"2026-12-0{day}T02:00:00+00:00", numerics=numerics,
                                    **glm) for day, numerics in ((2, "exact"), (3, "vllm")))
    history.record_run(path, vllm, "c/result.json")  # a write: the history is keyed again first
    old = history.get_run(path, 1)
    assert old.key.numerics == "exact" and old.key == history.configuration_of(exact)
    assert history.last_pass(path, history.configuration_of(exact)).id == 1
    assert history.last_pass(path, history.configuration_of(vllm)).id == 2
    assert [r.id for r in history.configuration_runs(path, history.configuration_of(exact))] == [1]


def test_export_csv_writes_formula_like_text_inert(tmp_path, capsys):
    """A text cell a spreadsheet would read as a formula (=, +, -, @, tab, CR first) is written to the CSV with a
    leading ' (OWASP's CSV-injection rule); numbers stay numbers, and the DataFrame keeps the values as recorded."""
    import pandas as pd

    import qual
    from cli_inprocess import qual_in

    path = tmp_path / "h.sqlite"
    meta = {"a": "=HYPERLINK(\"http://x\")", "b": "+1", "c": "-2", "d": "@SUM(A1)", "e": "\tx", "f": "\rx",
            "g": "plain", "h": "a=b"}
    night = replace(_night(1, 0.6), meta=meta)  # a failing night: its delta_rate is negative
    history.record_run(path, night, "a/result.json")
    proc = qual_in(capsys, "history", "export", tmp_path / "out", "--history", path)
    assert proc.returncode == 0, proc.stderr
    runs = pd.read_csv(tmp_path / "out" / "runs.csv", keep_default_na=False)
    written = {k: runs.loc[0, f"meta.{k}"] for k in meta}
    assert written == {k: ("'" + v if k in "abcdef" else v) for k, v in meta.items()}
    assert runs.loc[0, "delta_rate"] < 0 and runs["delta_rate"].dtype.kind == "f"
    assert runs.loc[0, "series"] == qual.load_history(path).runs.loc[0, "series"]
    assert {k: qual.load_history(path).runs.loc[0, f"meta.{k}"] for k in meta} == meta


def test_pins_are_listed_in_the_order_they_were_made_not_by_the_clock(db, capsys):
    """`qual history baseline list` puts the pin made last first, as nights go by their id: a clock set back between
    two pins does not reorder them; pinning a series again makes its pin the newest."""
    from cli_inprocess import qual_in

    history.pin(db, 4, "2026-12-10T00:00:00+00:00")
    history.pin(db, 5, "2026-12-09T00:00:00+00:00")  # the clock was set back a day
    assert [r.id for r, _ in history.list_pins(db)] == [5, 4]
    proc = qual_in(capsys, "history", "baseline", "list", "--history", db)
    assert proc.returncode == 0 and [line.split()[1] for line in proc.stdout.splitlines()] == ["5", "4"]
    history.pin(db, 2, "2026-12-08T00:00:00+00:00")  # replaces run 4's pin: the series of nights 1-4
    assert [r.id for r, _ in history.list_pins(db)] == [2, 5]
    history.unpin(db, 2)
    history.pin(db, 1, "2026-12-01T00:00:00+00:00")
    assert [r.id for r, _ in history.list_pins(db)] == [1, 5]


@pytest.mark.parametrize("axis", ["engine", "qual", "meta:cluster"])
def test_columns_off_the_date_axis_go_in_recording_order_after_the_clock_went_back(tmp_path, axis):
    """Off the date axis a night is a column, and the columns are the nights in the order they were recorded: a night
    whose clock was set back two days stays right of the nights before it, so each line runs left to right (no
    zigzag) and the labels read in recording order. The strip's tonight, not yet recorded, is the last column."""
    from qual.report import plots, trend

    path = tmp_path / "h.sqlite"
    for i, day in enumerate((3, 4, 2), start=1):  # the third night's clock ran two days behind
        night = _night(day)
        night.candidate.engine_version = f"vllm 0.3{i}.0"
        night.meta = {"cluster": f"c{i}"}
        night.candidate.provenance = replace(night.candidate.provenance, qual_version="0.1.0", qual_commit=str(i) * 40,
                                             qual_checkout_dirty=False)
        history.record_run(path, night, None)
    runs = sorted(history.list_runs(path), key=history.recorded_order)
    columns = [trend.column(r, axis) for r in runs]
    fig = plots.nights_figure([trend.arms_panel("s", runs, columns)], axis)
    ax = fig.axes[0]
    arms = [line for line in ax.lines if line.get_label() in ("control", "candidate")]
    assert [list(line.get_xdata()) for line in arms] == [[0, 1, 2]] * 2
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == [c.value for c in columns] and len(set(labels)) == 3
    tonight = plots.Column(trend.TONIGHT, trend.when("2026-12-01T00:00:00+00:00"), "tonight", "pass", None)
    strip = plots.Panel("acceptance (%)", [*columns, tonight], plots.arm_lines([0.7] * 4, [0.7] * 4), tonight=3)
    ax = plots.nights_figure([strip], axis).axes[0]
    arms = [line for line in ax.lines if line.get_label() in ("control", "candidate")]
    assert [list(line.get_xdata()) for line in arms] == [[0, 1, 2, 3]] * 2
    assert ax.get_xticklabels()[-1].get_text() == "tonight"
