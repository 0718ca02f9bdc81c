"""SQLite run history, step-change detection and the `qual history` commands (qual.history, qual.cli.history)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from qual import history
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

    v = history.SCHEMA_VERSION
    monkeypatch.setattr(history, "SCHEMA_VERSION", v + 1)
    monkeypatch.setitem(history.MIGRATIONS, v, add_notes)
    assert len(history.list_runs(db)) == 5
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT value FROM meta").fetchone()[0] == str(v + 1)
        assert "notes" in [r[1] for r in conn.execute("PRAGMA table_info(runs)")]
    conn.close()
    monkeypatch.setattr(history, "SCHEMA_VERSION", v + 2)
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
        conn.executescript(history._SCHEMA_V1)
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

_V1_COLUMNS = ", ".join(c for c in history._COLUMNS if c not in ("run_id", "configuration", "baseline", "qual_commit"))


def test_a_v1_history_is_migrated_and_its_runs_can_be_baselines(db, tmp_path):
    """A database written before baselines existed: each run gets its configuration from its stored config."""
    old = tmp_path / "v1.sqlite"
    with sqlite3.connect(old) as conn:
        conn.executescript(history._SCHEMA_V1)
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
        conn.executescript(history._SCHEMA_V1)
        conn.execute("INSERT INTO meta VALUES ('schema_version', '3')")
        history._migrate_v1_to_v2(conn)
        history._migrate_v2_to_v3(conn)
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
    assert columns[-3:] == ["configuration", "baseline", "qual_commit"] and "pins" in tables
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


def test_a_v5_history_keys_gain_numerics_and_keep_the_rest(tmp_path):
    """v5 keyed configurations without the target's numerics: v6 reads them from each row's stored candidate config
    and keeps the rest of the key as recorded; a GLM run recorded before numerics existed (sparse top-k recorded, no
    numerics) computed the one form there was, today's default ("exact"), and stays in the series a run of today
    without --numerics belongs to; a Qwen3 run's target has one form ("none"). Pins follow their runs."""
    path = tmp_path / "v5.sqlite"
    glm = synthetic_result(40, 0.75, 0.75, n_resamples=100, created_at="2026-12-02T02:00:00+00:00", model="glm-toy",
                           dsa_topk="exact", numerics="exact")
    toy = _night(3)
    history.record_run(path, glm, "a/result.json")
    history.record_run(path, toy, "b/result.json")
    keys = [replace(history.configuration_of(r), target="sha256:" + "1" * 64) for r in (glm, toy)]
    assert [k.numerics for k in keys] == ["exact", "none"]
    with sqlite3.connect(path) as conn:  # the rows and a pin as a v5 qual left them: no numerics anywhere
        for run_id, (key, night) in enumerate(zip(keys, (glm, toy)), 1):
            v5 = {k: v for k, v in json.loads(key.key()).items() if k != "numerics"}
            config = {arm: {k: v for k, v in getattr(night, arm).config.items() if k != "numerics"}
                      for arm in ("control", "candidate")}
            conn.execute("UPDATE runs SET configuration = ?, config_json = ? WHERE id = ?",
                         (json.dumps(v5), json.dumps(config), run_id))
            if run_id == 1:
                conn.execute("INSERT INTO pins VALUES (?, 1, '2026-12-03T00:00:00+00:00')", (json.dumps(v5),))
        conn.execute("UPDATE meta SET value = '5'")
    conn.close()
    assert [history.get_run(path, i).key for i in (1, 2)] == keys
    assert history.pinned_run(path, keys[0]).id == 1