"""Baselines: the configuration a run belongs to, history:last-pass and pins, matching (qual.baseline,
qual.harness.baseline), on synthetic results recorded into a temporary history."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from qual import history, paths
from qual.configuration import ConfigurationKey
from qual.cli.main import main
from qual.corpus import load_corpus
from qual.errors import QualError
from qual.harness.baseline import LAST_PASS, mismatches, resolve
from qual.harness.plan import RunOptions, make_plan
from qual.records import Sampling
from qual.result import load_result, save_result
from synthetic import SYNTHETIC_FINGERPRINT, synthetic_arm_config, synthetic_pair, synthetic_result

FAILING = [{"check": "mean_acceptance_length_ratio", "min": 1.5}]  # identical arms give 1.0: the gate fails

# name -> what differs from the configuration tonight's run belongs to ("same"), and the night it ran.
# Every row is a passing run unless its rules fail; all are recorded, then each is asked for by its own configuration.
RUNS = {
    "same, old pass": dict(day=1),
    "same, newest pass": dict(day=3),
    "same, newer but failing": dict(day=5, rules=FAILING),
    "other model": dict(day=6, model="tiny"),
    "other engine": dict(day=6, engine="vllm"),
    "other corpus": dict(day=6, fingerprint="sha256:" + "cd" * 32),
    "other temperature": dict(day=6, sampling=Sampling(temperature=0.7, seed=0, max_tokens=64)),
    "other sampling seed": dict(day=6, sampling=Sampling(temperature=0.0, seed=1, max_tokens=64)),
    "other max_tokens": dict(day=6, sampling=Sampling(temperature=0.0, seed=0, max_tokens=32)),
    "other selection (--limit)": dict(day=6, n=12),
    "other DCP": dict(day=6, dcp=2),
    "other dtype": dict(day=6, dtype="bfloat16"),
    "other K": dict(day=6, num_speculative_tokens=3),
    "other draft KV": dict(day=6, draft_kv="sharded"),
    "other interleave": dict(day=6, interleave=2),
    "other sparse top-k": dict(day=6, dsa_topk="union"),
    "other DCP merge path": dict(day=6, extra={"reference": {"dcp_comm": "invariant"}}),
    "other numerics": dict(day=6, numerics="vllm"),
    "other target": dict(day=6, target_path="models/other/target"),
    "other drafter": dict(day=6, draft_path="models/other/draft"),
    "other model, failing": dict(day=7, model="tiny", rules=FAILING),
    "only failing": dict(day=7, model="only-fails", rules=FAILING),
}
# tonight's configuration (as the run of that name) -> the run history:last-pass must pick (None: none passed)
EXPECTED = {
    "same, newest pass": "same, newest pass",
    "other model": "other model",
    "other engine": "other engine",
    "other corpus": "other corpus",
    "other temperature": "other temperature",
    "other sampling seed": "other sampling seed",
    "other max_tokens": "other max_tokens",
    "other selection (--limit)": "other selection (--limit)",
    "other DCP": "other DCP",
    "other dtype": "other dtype",
    "other K": "other K",
    "other draft KV": "other draft KV",
    "other interleave": "other interleave",
    "other sparse top-k": "other sparse top-k",
    "other DCP merge path": "other DCP merge path",
    "other numerics": "other numerics",
    "other target": "other target",
    "other drafter": "other drafter",
    "only failing": None,
}


def _night(day: int, n: int = 10, rules=None, fingerprint: str = SYNTHETIC_FINGERPRINT, dcp: int = 4, **arm):
    return synthetic_result(n, 0.7, 0.7, n_resamples=50, rules=rules, fingerprint=fingerprint, dcp=dcp,
                            created_at=f"2026-12-{day:02d}T02:00:00+00:00", **arm)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A history holding every run of RUNS, each with its result.json: (db, {name: run id}, {name: Result})."""
    root = tmp_path_factory.mktemp("history")
    db, ids, results = root / "history.sqlite", {}, {}
    for name, spec in RUNS.items():
        res = _night(**spec)
        path = save_result(res, root / f"run{len(ids)}" / "result.json")
        ids[name], results[name] = history.record_run(db, res, path), res
    assert results["same, newer but failing"].verdict == "fail" and results["other model"].verdict == "pass"
    return db, ids, results


@pytest.mark.parametrize("tonight", sorted(EXPECTED))
def test_last_pass_picks_the_newest_passing_run_of_the_same_configuration(recorded, tonight):
    db, ids, results = recorded
    configuration = history.configuration_of(results[tonight])
    want = EXPECTED[tonight]
    if want is None:  # the series' first night: nothing to compare with (exit 2 only where a baseline is required)
        assert resolve(LAST_PASS, db, configuration) is None
        with pytest.raises(QualError, match=r"--baseline history:last-pass: no passing run of model only-fails"):
            resolve(LAST_PASS, db, configuration, required=True)
        return
    got = resolve(LAST_PASS, db, configuration)
    assert (got.history_id, got.chosen_by) == (ids[want], "last pass"), f"picked {got.history_id}, wanted {want}"
    assert got.result.created_at == results[want].created_at
    # every run of that configuration, and no other, is its history (newest first)
    same = sorted(((RUNS[n]["day"], ids[n]) for n in RUNS if history.configuration_of(results[n]) == configuration),
                  reverse=True)
    assert [r.id for r in history.configuration_runs(db, configuration)] == [i for _, i in same]


def test_every_field_of_the_configuration_separates_runs(recorded):
    """The table covers the configuration: each of its fields is varied by some row (so none is left unchecked)."""
    _, _, results = recorded
    base = history.configuration_of(results["same, newest pass"])
    varied = {f for n in RUNS for f in ConfigurationKey.__dataclass_fields__
              if getattr(history.configuration_of(results[n]), f) != getattr(base, f)}
    # tp follows dcp here; one device
    assert varied == set(ConfigurationKey.__dataclass_fields__) - {"tp", "device"}


def test_another_configuration_is_a_first_night_or_refused_by_name_unless_forced(recorded):
    """history:last-pass with no run of tonight's key (and none of a series it follows) is that series' first night;
    with --baseline-required it names the nearest passing run and each field that differs; --baseline-any takes
    that run and keeps the differences."""
    db, ids, results = recorded
    tonight = replace(history.configuration_of(results["same, newest pass"]), device="cuda")  # no run used cuda
    nearest = ids["same, newest pass"]  # one field apart (the device), the newer of two such; every "other" run is two
    assert resolve(LAST_PASS, db, tonight) is None
    with pytest.raises(QualError, match=rf"no passing run of this configuration .* the nearest, run {nearest} .* "
                                        r"differs in device: this run cuda, baseline cpu; pass --baseline-any"):
        resolve(LAST_PASS, db, tonight, required=True)
    got = resolve(LAST_PASS, db, tonight, any_key=True)
    assert (got.history_id, got.chosen_by, got.forced) == (nearest, "nearest pass", True)
    assert got.key_differences == [("device", "cuda", "cpu")]


def test_last_pass_reads_the_models_passing_nights_once(recorded, monkeypatch):
    """Where tonight's key has no pin and no pass, history:last-pass looks among the model's passing nights for the
    series before and the nearest key: one read of those rows serves both."""
    from qual.history import baselines

    db, _, results = recorded
    tonight = replace(history.configuration_of(results["same, newest pass"]), device="cuda")  # no run used cuda
    reads = []

    def counted(db_path, sql, args=()):
        reads.append(sql)
        return select(db_path, sql, args)

    select = baselines.select
    monkeypatch.setattr(baselines, "select", counted)
    assert resolve(LAST_PASS, db, tonight, any_key=True).chosen_by == "nearest pass"
    assert sum("WHERE model = ?" in sql for sql in reads) == 1, reads


def test_a_pinned_run_wins_over_the_last_pass_until_unpinned(recorded):
    db, ids, results = recorded
    configuration = history.configuration_of(results["same, newest pass"])
    old = ids["same, old pass"]
    run, replaced = history.pin(db, old, "2026-12-08T00:00:00+00:00")
    assert run.id == old and replaced is None
    got = resolve(LAST_PASS, db, configuration)
    assert (got.history_id, got.chosen_by) == (old, "pinned")
    # a failing run can be pinned (it is asked for by id), and replaces the earlier pin of its configuration
    failing = ids["same, newer but failing"]
    assert history.pin(db, failing, "2026-12-09T00:00:00+00:00")[1] == old
    assert resolve(LAST_PASS, db, configuration).history_id == failing
    # pins belong to one configuration: another's last pass is untouched
    other = history.configuration_of(results["other model"])
    assert resolve(LAST_PASS, db, other).history_id == ids["other model"]
    assert [r.id for r, _ in history.list_pins(db)] == [failing]
    history.unpin(db, failing)
    assert resolve(LAST_PASS, db, configuration).history_id == ids["same, newest pass"]
    with pytest.raises(QualError, match=f"run {failing} is not pinned"):
        history.unpin(db, failing)


def test_history_ids_and_paths_resolve(recorded, tmp_path):
    db, ids, results = recorded
    configuration = history.configuration_of(results["same, newest pass"])
    i = ids["other engine"]
    for ref in (str(i), f"history:{i}"):
        # a served vLLM's numerics are its build's (qual.configuration): another engine differs in both
        with pytest.raises(QualError, match=r"is another configuration: engine: this run reference, baseline vllm; "
                                            r"numerics: this run exact, baseline build; pass --baseline-any"):
            resolve(ref, db, configuration)
        got = resolve(ref, db, configuration, any_key=True)
        assert (got.history_id, got.chosen_by, got.key_differences) == (
            i, "history id", [("engine", "reference", "vllm"), ("numerics", "exact", "build")])
    got = resolve(str(ids["same, old pass"]), db, configuration)
    by_path = resolve(str(got.path.parent), db, configuration)
    assert (by_path.history_id, by_path.chosen_by, by_path.path) == (None, "result file", got.path)
    assert resolve(str(got.path), db, configuration).result.to_json() == load_result(got.path).to_json()
    for ref, words in [("history:yesterday", "unknown history reference"), ("999", "no run 999"),
                       (str(tmp_path / "nowhere"), "no result file at"),
                       (str(tmp_path), "no result file at")]:
        with pytest.raises(QualError, match=words):
            resolve(ref, db, configuration)
    with pytest.raises(QualError, match="no run history at"):
        resolve("3", tmp_path / "none.sqlite", configuration)
    assert resolve(LAST_PASS, tmp_path / "none.sqlite", configuration) is None  # a first night
    with pytest.raises(QualError, match="no passing run of model toy"):
        resolve(LAST_PASS, tmp_path / "none.sqlite", configuration, required=True)


def test_a_missing_result_file_is_named(tmp_path):
    db = tmp_path / "h.sqlite"
    res = _night(1)
    run_id = history.record_run(db, res, tmp_path / "gone" / "result.json")
    with pytest.raises(QualError, match=rf"run {run_id}'s result file .*gone/result.json is missing"):
        resolve(LAST_PASS, db, history.configuration_of(res))


# ---------------------------------------------------------------- matching


def _tonight(**change):
    arm = synthetic_arm_config(4, **change)
    return {"control": replace(arm, dcp=1), "candidate": arm}


IDS = [f"r{i:03d}" for i in range(10)]


@pytest.mark.parametrize(
    "arms, fingerprint, ids, words",
    [
        (_tonight(), "sha256:" + "cd" * 32, IDS, "corpus fingerprint: baseline sha256:abab"),
        (_tonight(sampling=Sampling(0.7, 0, 64)), SYNTHETIC_FINGERPRINT, IDS, "sampling temperature: baseline 0.0, this run 0.7"),
        (_tonight(sampling=Sampling(0.0, 0, 32)), SYNTHETIC_FINGERPRINT, IDS, "sampling max_tokens: baseline 64, this run 32"),
        (_tonight(model="glm-5.3-flash"), SYNTHETIC_FINGERPRINT, IDS, "model: baseline toy, this run glm-5.3-flash"),
        (_tonight(num_speculative_tokens=3), SYNTHETIC_FINGERPRINT, IDS, "num_speculative_tokens: baseline 7, this run 3"),
        (_tonight(), SYNTHETIC_FINGERPRINT, ["x1", "x2"], "none of this run's 2 requests is in the baseline's control arm"),
    ],
)
def test_mismatches_name_what_differs(arms, fingerprint, ids, words):
    found = mismatches(_night(1), arms, fingerprint, ids)
    assert found and any(words in f for f in found), found


def test_engine_layout_and_paths_may_differ_and_a_subset_of_requests_matches():
    arms = _tonight(engine="vllm", tp=8, dtype="bfloat16", target_path="/elsewhere", device="cuda")
    arms["candidate"] = replace(arms["candidate"], dcp=8, draft_kv="unknown")
    assert mismatches(_night(1), arms, SYNTHETIC_FINGERPRINT, IDS[:3]) == []


# ---------------------------------------------------------------- through `qual run --dry-run` (in process)


def qual(argv, capsys) -> tuple[int, str, str]:
    old = sys.argv
    sys.argv = ["qual", *map(str, argv)]
    try:
        with pytest.raises(SystemExit) as done:
            main()
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


@pytest.fixture(scope="module")
def toy_baseline(tmp_path_factory):
    """A synthetic result that matches `qual run --limit 4` of the toy profile (humaneval, greedy, 64 tokens, K=7)."""
    plan = make_plan(RunOptions(limit=4), dry_run=True)
    ids = [r.id for r in load_corpus("humaneval").requests[:4]]
    control, candidate = synthetic_pair(4, 0.7, 0.7)
    control = [replace(r, id=i, category="code") for r, i in zip(control, ids)]
    candidate = [replace(r, id=i, category="code") for r, i in zip(candidate, ids)]
    toy = plan.arms["candidate"]  # the real checkpoints: their identities are tonight's
    res = synthetic_result(pair=(control, candidate), n_resamples=50, fingerprint=plan.corpus_info["fingerprint"],
                           corpus_name="humaneval", tp=4, target_path=toy.target_path, draft_path=toy.draft_path,
                           extra=toy.extra)  # the engine's options as the run records them (its DCP merge path)
    return save_result(res, tmp_path_factory.mktemp("baseline") / "result.json").parent


@pytest.mark.parametrize(
    "extra, key_words, words",
    [
        ([], None, None),
        (["--corpus", "smoke"], "corpus_fingerprint: this run", "corpus fingerprint: baseline"),
        (["--temperature", "0.5"], "temperature: this run 0.5, baseline 0.0",
         "sampling temperature: baseline 0.0, this run 0.5"),
        (["--max-tokens", "32"], "max_tokens: this run 32, baseline 64", "sampling max_tokens: baseline 64, this run 32"),
        (["--model", "glm-5.3-flash"], "model: this run glm-5.3-flash, baseline toy",
         "model: baseline toy, this run glm-5.3-flash"),
        (["--limit", "5"], "n_requests: this run 5, baseline 4", None),  # compared on the 4 requests both ran
        (["--dcp", "2"], "tp: this run 2, baseline 4; dcp: this run 2, baseline 4", None),
    ],
)
def test_dry_run_checks_the_baseline_before_anything_runs(toy_baseline, tmp_path, capsys, extra, key_words, words):
    """Another configuration key is refused, naming each field; --baseline-any takes it, but never one that cannot be
    compared request by request (another model, corpus, sampling, K, or requests it lacks)."""
    argv = ["run", "--limit", "4", "--dry-run", "--baseline", toy_baseline, "--history", tmp_path / "h.sqlite", *extra]
    code, out, err = qual(argv, capsys)
    if key_words is None:
        assert code == 0, err
        assert "# baseline: " in out and "the same configuration" in out
        return
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --baseline {toy_baseline}: ") and key_words in lines[0], err
    assert "is another configuration" in lines[0] and not (tmp_path / "h.sqlite").exists()
    code, out, err = qual([*argv, "--baseline-any"], capsys)
    if words is None:
        assert code == 0, err
        assert f"another configuration, taken with --baseline-any: {key_words}" in out
        return
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "does not match this run" in lines[0] and words in lines[0], err


def test_a_gate_that_needs_a_baseline_is_refused_without_one(tmp_path, capsys):
    code, _, err = qual(["run", "--dry-run", "--gate", "nightly-baseline"], capsys)  # a shipped gate, by name
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{paths.shipped('gate', 'nightly-baseline')}: rule 6 (baseline_delta_lower_bound) compares with a " \
           "baseline: give --baseline REF" in err
    skip = tmp_path / "skip.yaml"
    skip.write_text("rules:\n  - {check: per_position_delta, max_pp: 2, without_baseline: skip}\n")
    code, _, err = qual(["run", "--dry-run", "--gate", skip], capsys)
    assert code == 0, err


def test_pinning_a_sweeps_directory_pins_each_of_its_candidates(tmp_path, capsys):
    """A sweep records a row per candidate from one folder, each in its own series: accepting that night by its
    directory (the CI template's `pin` input) pins every one of them, not the last one alone; an earlier night
    recorded from the same folder is left as it is."""
    from qual.cli.main import _register, run_app

    _register()
    db, out = tmp_path / "h.sqlite", tmp_path / "sweep"
    out.mkdir()
    save_result(_night(1, dcp=4), out / "result.json")
    earlier = history.record_run(db, _night(1, dcp=4), out / "result.json", run_id="night1")
    ids = [history.record_run(db, _night(2, dcp=dcp), out / "result.json", run_id=f"night2/candidate-dcp{dcp}")
           for dcp in (2, 4)]
    assert run_app(["history", "baseline", "pin", str(out), "--history", str(db)]) == 0
    assert sorted(r.id for r, _ in history.list_pins(db)) == ids and earlier not in ids
    assert [r.id for r in history.find_night(db, str(ids[0]))] == [ids[0]]
