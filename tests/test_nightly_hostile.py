"""The nightly loop against a careless user: gate and corpus files edited while or between nights run, nights
recorded out of clock order, a prune beside a running night or stopped part-way, a history and run folders from an
older qual."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from checkpoints import make_profile
from qual.harness.execute import execute
from qual.harness.plan import make_plan, run_options

REPO_CORPORA = Path(__file__).resolve().parents[1] / "corpora"

STRICT = {"rules": [{"check": "candidate_runnable"}, {"check": "acceptance_floor", "min_rate": 0.0}]}


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return make_profile(tmp_path_factory.mktemp("nightly"), max_tokens=8)


@pytest.mark.parametrize("edit", ["broken", "stricter", "deleted"])
def test_a_gate_edited_while_the_arms_run_judges_by_the_rules_read_at_the_start(profile, tmp_path, edit):
    """A night's verdict, run.json and provenance all name the gate as it was when the night began: a `git pull` or an
    editor touching the gate file mid-night neither loses the night (a broken file read after an hour of replay) nor
    judges it by rules its records do not name."""
    gate = tmp_path / "gate.yaml"
    gate.write_text(yaml.safe_dump(STRICT))
    digest = "sha256:" + hashlib.sha256(gate.read_bytes()).hexdigest()
    plan = make_plan(run_options(model=str(profile), dcp="1", tp=1, limit=2, gate=str(gate), out=str(tmp_path / "out"),
                                 history=str(tmp_path / "h.sqlite")))
    if edit == "broken":
        gate.write_text("rules: [{check: no_such_check}\n")
    elif edit == "stricter":  # no run of the tiny pair reaches a 100% acceptance rate
        gate.write_text(yaml.safe_dump({"rules": [{"check": "acceptance_floor", "min_rate": 1.0}]}))
    else:
        gate.unlink()
    result, _, _ = execute(plan)
    assert result.gate.passed and [c.name for c in result.gate.checks] == ["candidate_runnable", "acceptance_floor"]
    recorded = json.loads((tmp_path / "out" / "result.json").read_text())
    assert {recorded["arms"][arm]["provenance"]["gate_sha256"] for arm in ("control", "candidate")} == {digest}
    assert json.loads((tmp_path / "out" / "run.json").read_text())["inputs"]["gate"]["sha256"] == digest


def test_a_night_recorded_with_a_clock_set_ahead_does_not_stay_the_newest(tmp_path):
    """A runner's clock ran a year ahead for one night, then was set right: the nights after it are newer than it
    (recorded later), so the series' last pass, the newest-first list, the series' order and the step changes follow
    the order the nights were recorded in, not the dates they carry."""
    from qual import history
    from qual.history.prune import prune
    from synthetic import synthetic_result

    db = tmp_path / "h.sqlite"
    dated = [("2027-12-01T02:00:00+00:00", 0.75), ("2026-12-02T02:00:00+00:00", 0.75),
             ("2026-12-03T02:00:00+00:00", 0.70)]  # the last night's candidate 5 pp down: a step change, and passing
    ids = []
    for n, (when, p) in enumerate(dated, 1):
        night = synthetic_result(40, 0.75, p, n_resamples=50, created_at=when, rules=[{"check": "candidate_runnable"}])
        (tmp_path / "runs" / f"{n}").mkdir(parents=True)
        (tmp_path / "runs" / f"{n}" / "run.json").write_text("{}")
        ids.append(history.record_run(db, night, f"{tmp_path}/runs/{n}/result.json"))
    key = history.configuration_of(night)
    assert history.last_pass(db, key).id == ids[-1]
    assert [r.id for r in history.list_runs(db)] == ids[::-1]
    assert [r.id for r in history.configuration_runs(db, key)] == ids[::-1]
    assert [[r.id for r in rows] for rows in history.trend(db).values()] == [ids]
    assert [(s.previous_run_id, s.run_id) for s in history.detect_step_changes(history.list_runs(db))] == [
        (ids[1], ids[2])]
    assert history.baseline_result_paths(db) == [f"{tmp_path}/runs/3/result.json"]
    assert prune(tmp_path / "runs", 0, db).kept == [str(tmp_path / "runs" / "3")]  # the last pass's folder stays


def test_prune_leaves_a_run_directory_a_running_night_holds(tmp_path, capsys):
    """`qual history prune` while a night runs (a person by hand, another job) never removes that night's folder from
    under it, whatever its name sorts as and whatever --keep says: a folder a qual process holds is left and named."""
    from cli_inprocess import qual_in
    from qual.files import DirectoryLock

    runs = tmp_path / "runs"
    for name in ("1-1", "2-1"):
        (runs / name).mkdir(parents=True)
        (runs / name / "run.json").write_text("{}")
    running = DirectoryLock(runs / "1-1", "--out")  # as `qual run --out runs/1-1` holds it while its arms run
    try:
        done = qual_in(capsys, "history", "prune", runs, "--keep", 0, "--history", tmp_path / "none.sqlite")
    finally:
        running.release()
    assert done.returncode == 0, done.stderr
    assert (runs / "1-1" / "run.json").is_file() and not (runs / "2-1").exists()
    assert f"left {runs / '1-1'} (in use by a running qual process" in done.stdout


def test_a_run_started_before_any_option_existed_resumes_with_that_options_default(profile, tmp_path):
    """A night killed under an older qual, resumed by this one: an option that qual did not have yet is missing from
    its run.json and stands for its default, the behaviour from before the option existed, whatever that default is
    (--axis's is `date`, not None): no option added to qual makes such a run unresumable."""
    from dataclasses import fields

    from qual.harness.inputs import check_unchanged, seal
    from qual.harness.plan import PLAN_FILE, RunOptions, load_plan

    plan = make_plan(run_options(model=str(profile), dcp="1", tp=1, limit=2, out=str(tmp_path / "out"),
                                 history=str(tmp_path / "h.sqlite")))
    plan.out_dir.mkdir()
    plan.save()
    written = json.loads((plan.out_dir / PLAN_FILE).read_text())
    # each option this run left at its default: a qual from before the option existed wrote no key for it
    defaults = {f.name: getattr(f.default, "default", f.default) for f in fields(RunOptions)}  # pydantic's Field too
    left_at_default = [name for name, value in defaults.items() if written["options"].get(name, 0) == value]
    assert {"axis", "meta", "speedup", "baseline", "gate", "engine", "seed"} <= set(left_at_default)
    for option in left_at_default:
        older = {k: v for k, v in written.items() if k != "sealed"}
        older["options"] = {k: v for k, v in written["options"].items() if k != option}
        older["inputs"] = {**written["inputs"],
                           "options": {k: v for k, v in written["inputs"]["options"].items() if k != option}}
        (plan.out_dir / PLAN_FILE).write_text(json.dumps(seal(older)))
        saved = load_plan(plan.out_dir)
        again = make_plan(saved.options, run_id=saved.run_id)
        check_unchanged(saved.inputs, again.inputs, plan.out_dir)  # raises naming the option where it would refuse


def test_a_night_recorded_by_an_older_qual_is_the_series_before_the_first_night_after_the_upgrade(tmp_path):
    """A history from a qual that kept neither the checkpoints' identities nor the DCP merge path: its rows' keys say
    `unknown` there (the migrations' reading of them). The first night after the upgrade knows all three, so it is a
    new series; its series before is the old one (what it cannot know is no difference), so the upgrade night is held
    to the old level instead of passing on the paired gate alone. A field both sides know and that differs still
    parts them."""
    from dataclasses import replace

    from qual import history
    from qual.configuration import NO_IDENTITY, is_successor
    from synthetic import synthetic_result

    db = tmp_path / "h.sqlite"
    night = synthetic_result(40, 0.75, 0.75, n_resamples=50, extra={"reference": {"dcp_comm": "a2a"}})
    tonight = history.configuration_of(night)
    assert NO_IDENTITY not in (tonight.target, tonight.draft, tonight.dcp_comm)
    older = replace(tonight, target=NO_IDENTITY, draft=NO_IDENTITY, dcp_comm=NO_IDENTITY)
    other_dtype = replace(older, dtype="bfloat16" if tonight.dtype != "bfloat16" else "float32")
    rows = {}
    for name, key in (("older", older), ("other_dtype", other_dtype)):
        rows[name] = history.record_run(db, night, f"{name}/result.json")
        with sqlite3.connect(db) as conn:  # the row as a migration from the older qual keyed it
            conn.execute("UPDATE runs SET configuration = ? WHERE id = ?", (key.key(), rows[name]))
        conn.close()
    assert history.last_pass(db, tonight) is None
    assert history.previous_series_pass(history.model_passes(db, tonight.model), tonight).id == rows["older"]
    assert not is_successor(tonight, other_dtype) and is_successor(tonight, older)


def test_a_prune_stopped_at_any_file_leaves_nothing_the_next_prune_cannot_finish(tmp_path, monkeypatch):
    """`qual history prune` stopped part-way (a cancelled CI step: SIGTERM is a KeyboardInterrupt in qual, raised
    between any two removals): whatever it had removed, the next prune removes the rest of that run directory, never
    leaving a folder of orphaned files it no longer recognises as a run's."""
    import os

    from qual.history.prune import prune

    def night(runs, name):
        (runs / name / "logs").mkdir(parents=True)
        for f in ("run.json", "result.json", "report.html", "control.requests.jsonl", "logs/control.log"):
            (runs / name / f).write_text("x")

    removals = 6  # the files and folders of one run directory
    for stop_at in range(removals):
        runs = tmp_path / f"runs{stop_at}"
        night(runs, "1-1")
        night(runs, "2-1")
        calls = []
        real_unlink, real_rmdir = os.unlink, os.rmdir

        def stopping(real):
            def remove(*args, **kw):
                calls.append(args)
                if len(calls) > stop_at:
                    raise KeyboardInterrupt
                return real(*args, **kw)
            return remove

        monkeypatch.setattr(os, "unlink", stopping(real_unlink))
        monkeypatch.setattr(os, "rmdir", stopping(real_rmdir))
        with pytest.raises(KeyboardInterrupt):
            prune(runs, 1, tmp_path / "none.sqlite")
        monkeypatch.setattr(os, "unlink", real_unlink)
        monkeypatch.setattr(os, "rmdir", real_rmdir)
        done = prune(runs, 1, tmp_path / "none.sqlite")
        assert sorted(p.name for p in runs.iterdir()) == ["2-1"] and done.left == [], (stop_at, done)


def test_a_corpus_edited_between_nights_is_named_before_its_first_night_runs(profile, tmp_path):
    """An edited corpus file (its fingerprint is part of the configuration key) starts a new series, whose first
    night has no baseline and passes on the paired gate alone: before it runs, the user hears that, with the nearest
    recorded pass and what differs (the corpus fingerprint), not only "first night of this series"."""
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text((REPO_CORPORA / "smoke.jsonl").read_text().splitlines()[0] + "\n")
    db = tmp_path / "h.sqlite"

    def night(n):
        return make_plan(run_options(model=str(profile), dcp="1", tp=1, corpus=str(corpus), gate="nightly-baseline",
                                     baseline="history:last-pass", out=str(tmp_path / f"out{n}"), history=str(db)))

    first = night(1)
    assert first.first_night and not any("nearest" in n for n in first.notes)  # nothing recorded: nothing to name
    assert execute(first)[0].gate.passed
    row = json.loads(corpus.read_text())
    corpus.write_text(json.dumps({**row, "prompt": row["prompt"] + " Answer briefly."}) + "\n")
    edited = night(2)
    assert edited.first_night
    recorded = json.loads((tmp_path / "out1" / "result.json").read_text())["created_at"]
    assert [n for n in edited.notes if "nearest" in n] == [
        f"--baseline history:last-pass: the first night of this configuration, so no baseline: the nearest, run 1 "
        f"of {recorded}, differs in "
        f"corpus_fingerprint: this run {edited.corpus_info['fingerprint'][:19]}, baseline "
        f"{first.corpus_info['fingerprint'][:19]} (--baseline-any compares with it; --baseline-required refuses a "
        "first night)"]


@pytest.mark.parametrize("value", ["a\nb", "a\x1b[2Jb", "a\x7fb", "a\x85b", "a\x9bb", "a\u202eb", "a\u2066b"])
def test_a_meta_value_holding_any_control_character_is_refused_as_its_message_says(value):
    """--meta's "without control characters" means the set every display of qual escapes (qual.shown): a NEL (a line
    break to str.splitlines), a C1 CSI or a bidirectional override is refused like a newline, not recorded raw into
    result.json, junit.xml, the history, exports and plots."""
    from qual.errors import QualError
    from qual.nights import parse_meta

    with pytest.raises(QualError, match="without control characters"):
        parse_meta([f"ci_run={value}"])
    assert parse_meta(["ci_run=https://ci/x?a=1&b=<2> \u00e9\u4e2d"]) == {"ci_run": "https://ci/x?a=1&b=<2> \u00e9\u4e2d"}
