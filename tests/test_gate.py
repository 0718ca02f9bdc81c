"""Gate rules: parsing and validation, and each check on synthetic results (qual.gate)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from qual.records import GraphCapture
from qual.errors import QualError
from qual.paths import default_gate
from qual.gate import BASELINE_CHECKS, CHECKS, evaluate, load_gate, parse_rules
from synthetic import NIGHTLY_RULES, synthetic_pair, synthetic_request, synthetic_result

NIGHTLY = default_gate()


def _check(result, name):
    (c,) = [c for c in result.gate.checks if c.name == name]
    return c


def test_nightly_gate_file_loads():
    gate = load_gate(NIGHTLY)
    assert [r.check for r in gate.rules] == [
        "candidate_runnable", "acceptance_delta_lower_bound", "mean_acceptance_length_ratio",
        "target_outputs_identical", "graph_sizes_captured", "acceptance_floor",
    ]
    assert gate.rules[1].params == {"min_pp": -0.5, "confidence": 0.95}
    # nightly.yaml: every check that needs no baseline; nightly-baseline.yaml: all of them, nightly's rules first
    assert set(r.check for r in gate.rules) == set(CHECKS) - set(BASELINE_CHECKS)
    with_baseline = load_gate(NIGHTLY.with_name("nightly-baseline.yaml"))
    assert set(r.check for r in with_baseline.rules) == set(CHECKS)
    assert [r.to_json() for r in with_baseline.rules[: len(gate.rules)]] == [r.to_json() for r in gate.rules]


def test_identical_arms_pass_and_an_8pp_drop_fails():
    ok = synthetic_result(120, 0.75, 0.75)
    assert ok.gate.passed, [c.detail for c in ok.gate.failed]
    bad = synthetic_result(120, 0.75, 0.68, draft_kv="sharded")
    assert bad.comparison.delta_rate == pytest.approx(-0.08, abs=0.015)
    assert not bad.gate.passed
    failed = {c.name for c in bad.gate.failed}
    assert failed == {"acceptance_delta_lower_bound", "mean_acceptance_length_ratio"}
    detail = _check(bad, "acceptance_delta_lower_bound").detail
    assert "95% CI" in detail and "< -0.50 pp" in detail and f"{bad.comparison.delta_rate * 100:+.2f} pp" in detail


def test_small_drop_inside_tolerance_passes():
    # 0.75 -> 0.749 per token is ~ -0.2 pp: inside -0.5 pp at the lower bound with paired data.
    res = synthetic_result(200, 0.75, 0.749)
    assert -0.005 < res.comparison.delta_rate < 0
    assert _check(res, "acceptance_delta_lower_bound").passed


def test_other_confidence_levels_are_computed_for_the_gate():
    rules = [{"check": "acceptance_delta_lower_bound", "min_pp": -0.5, "confidence": 0.8}]
    res = synthetic_result(60, rules=rules)
    assert set(res.comparison.delta_rate_ci) == {"0.8", "0.95"}
    assert "80% CI" in res.gate.checks[0].detail


@pytest.mark.parametrize(
    "rules, message",
    [
        ([{"check": "nope"}], r"g\.yaml: rule 0: unknown check 'nope'"),
        ([{"check": "candidate_runnable"}, {"check": "mean_acceptance_length_ratio"}], r"rule 1 .*missing parameter 'min'"),
        ([{"check": "mean_acceptance_length_ratio", "min": "high"}], r"rule 0 .*min must be a positive number"),
        ([{"check": "acceptance_delta_lower_bound", "min_pp": -1, "confidence": 95}], r"confidence must be a number in \(0, 1\)"),
        ([{"check": "graph_sizes_captured", "sizes": [1]}], r"unknown parameter\(s\) \['sizes'\]"),
        ([{"check": "target_outputs_identical", "allow": "anything"}], r"allow must be"),
        ([{"min": 1}], r"rule 0: expected a mapping with a 'check' key"),
        ([], r"non-empty list of rules"),
        ({"rules": [{"check": "candidate_runnable"}], "extra": 1}, r"unknown top-level keys"),
    ],
)
def test_bad_rules_name_file_and_rule(rules, message):
    with pytest.raises(QualError, match=message):
        parse_rules(rules, "g.yaml")


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "gate.yaml"
    p.write_text("rules:\n  - {check: candidate_runnable\n")
    with pytest.raises(QualError, match=r"gate\.yaml:\d+: invalid YAML"):
        load_gate(p)
    with pytest.raises(QualError, match="cannot read gate file"):
        load_gate(tmp_path / "missing.yaml")


def test_graph_sizes_captured():
    unsupported = _check(synthetic_result(10), "graph_sizes_captured")
    assert unsupported.passed and "unsupported in both arms" in unsupported.detail
    full = GraphCapture("captured", "FULL", [1, 2, 4, 8])
    same = synthetic_result(10, control_graph=full, candidate_graph=replace(full))
    assert _check(same, "graph_sizes_captured").passed
    missing = synthetic_result(10, control_graph=full, candidate_graph=GraphCapture("captured", "FULL", [1, 2, 4]))
    c = _check(missing, "graph_sizes_captured")
    assert not c.passed and "[8]" in c.detail
    fallback = GraphCapture("captured", "FULL", [1, 2, 4, 8], eager_fallback_sizes=[4])
    c = _check(synthetic_result(10, control_graph=full, candidate_graph=fallback), "graph_sizes_captured")
    assert not c.passed and "ran eager: [4]" in c.detail
    failed = GraphCapture("failed", detail="CUDA error: out of memory")
    c = _check(synthetic_result(10, control_graph=full, candidate_graph=failed), "graph_sizes_captured")
    assert not c.passed and "out of memory" in c.detail
    # More sizes in the candidate than in control is fine.
    assert _check(synthetic_result(10, control_graph=GraphCapture(), candidate_graph=full), "graph_sizes_captured").passed


def _divergent_pair(margin):
    control, candidate = synthetic_pair(6, 0.7, 0.7)
    k0 = candidate[0]
    out = list(k0.output_token_ids)
    out[3] = 88
    margins = [5.0] * len(out)
    margins[3] = margin
    margins = None if margin is None else margins  # engine without margins
    candidate[0] = replace(k0, output_token_ids=out, top2_margins=margins)
    return control, candidate


@pytest.mark.parametrize(
    "margin, allow, passed, words",
    [
        (0.01, "benign_near_tie", True, "1 benign near-tie"),
        (0.01, "none", False, "near ties not allowed"),
        (4.0, "benign_near_tie", False, "1 disagreement: r000@3 (margin 4)"),
        (None, "benign_near_tie", False, "(margin n/a)"),
    ],
)
def test_target_outputs_identical(margin, allow, passed, words):
    rules = [{"check": "target_outputs_identical", "when_temperature": 0, "allow": allow}]
    res = synthetic_result(pair=_divergent_pair(margin), rules=rules)
    c = res.gate.checks[0]
    assert c.passed is passed and words in c.detail, c.detail
    assert "1/6 requests diverge" in c.detail


def test_target_outputs_check_skipped_when_sampling():
    from synthetic import synthetic_arm_config, synthetic_run_info, synthetic_gate
    from qual.harness.build import build_result
    from qual.result import CorpusInfo

    control, candidate = _divergent_pair(4.0)
    res = build_result(
        CorpusInfo("s", "s.jsonl", "sha256:0", 6),
        (synthetic_arm_config(1, temperature=0.8), synthetic_run_info(control), control),
        (synthetic_arm_config(4, temperature=0.8), synthetic_run_info(candidate), candidate),
        synthetic_gate([{"check": "candidate_runnable"}, {"check": "target_outputs_identical", "when_temperature": 0}]),
        seed=0,
        n_resamples=50,
    )
    skipped = res.gate.checks[1]
    assert res.gate.passed and skipped.skipped and skipped.detail.startswith("skipped: temperature 0.8")


def test_candidate_not_runnable_fails_cleanly():
    from synthetic import synthetic_arm_config, synthetic_run_info, synthetic_gate
    from qual.harness.build import build_result
    from qual.result import CorpusInfo

    control, _ = synthetic_pair(5, 0.7, 0.7)
    res = build_result(
        CorpusInfo("s", "s.jsonl", "sha256:0", 5),
        (synthetic_arm_config(1), synthetic_run_info(control), control),
        (synthetic_arm_config(4), synthetic_run_info([], runnable=False, reason="DCP needs LSE from the CPU backend"), []),
        synthetic_gate(NIGHTLY_RULES),
        seed=0,
    )
    assert not res.gate.passed
    assert "DCP needs LSE" in _check(res, "candidate_runnable").detail
    assert "no draft tokens in candidate" in _check(res, "acceptance_delta_lower_bound").detail
    assert not _check(res, "mean_acceptance_length_ratio").passed


def test_no_drafter_in_either_arm_fails_with_reason():
    control = [synthetic_request("a", []), synthetic_request("b", [])]
    res = synthetic_result(pair=(control, list(control)))
    c = _check(res, "acceptance_delta_lower_bound")
    assert not c.passed and "no draft tokens in control and candidate" in c.detail


def test_evaluate_is_reusable_on_a_result():
    res = synthetic_result(30)
    again = evaluate(parse_rules([{"check": "mean_acceptance_length_ratio", "min": 1.5}]), res)
    assert not again.passed and "1.0000 < 1.5000" in again.checks[0].detail


# ---------------------------------------------------------------- checks against a baseline, floors

BASELINE_RULES = [
    {"check": "baseline_delta_lower_bound", "min_pp": -1.0},
    {"check": "per_position_delta", "max_pp": 2.0},
    {"check": "category_delta", "max_pp": 3.0},
]


@pytest.fixture(scope="module")
def baseline_night(tmp_path_factory):
    """Last night's synthetic run (120 requests, 3 categories), saved and resolved as a baseline."""
    from synthetic import as_baseline

    res = synthetic_result(120, 0.7, 0.7, n_resamples=200, created_at="2026-11-30T02:00:00+00:00")
    return as_baseline(res, tmp_path_factory.mktemp("baseline") / "result.json", history_id=7, chosen_by="last pass")


def _tonight(baseline, keep=None, only=None, rules=BASELINE_RULES, **kw):
    from synthetic import truncated

    b = baseline.result
    pair = (b.control.per_request, b.candidate.per_request)
    if keep is not None:  # both arms lose the same: the paired DCP comparison cannot see it
        pair = (truncated(pair[0], keep, only), truncated(pair[1], keep, only))
    return synthetic_result(pair=pair, rules=rules, n_resamples=200, baseline=baseline, **kw)


def test_an_unchanged_night_passes_every_baseline_check(baseline_night):
    res = _tonight(baseline_night)
    assert res.gate.passed, [c.detail for c in res.gate.failed]
    for arm in ("control", "candidate"):
        b = res.baseline.arms[arm]
        assert b.compared and b.delta_rate == 0 and b.ci_at(0.95) == (0.0, 0.0) and b.moved == []
        assert all(p["delta"] == 0 for p in b.per_position) and not b.retokenized
    assert "no position of 7 dropped" in _check(res, "per_position_delta").detail
    assert res.baseline.label == "run 7 (last pass)" and res.baseline.differs == []


def test_a_drop_from_position_3_on_in_both_arms_fails_and_names_the_positions(baseline_night):
    res = _tonight(baseline_night, keep=3)
    # the paired DCP gate cannot see it: both arms lost the same
    assert res.comparison.delta_rate == 0
    assert {c.name for c in res.gate.failed} == {"baseline_delta_lower_bound", "per_position_delta", "category_delta"}
    pos = _check(res, "per_position_delta").detail
    for arm in ("control", "candidate"):
        assert f"{arm}: position(s) 3, 4, 5, 6 dropped more than 2.00 pp against the baseline" in pos, pos
    assert "0:" not in pos.split("dropped")[1].split(";")[0]  # positions before 3 are not named
    rows = res.baseline.arms["control"].per_position
    assert [p["delta"] for p in rows[:3]] == [0, 0, 0] and all(p["delta"] < 0 and p["ci"][1] < 0 for p in rows[3:])
    bound = _check(res, "baseline_delta_lower_bound").detail
    assert "control" in bound and "candidate" in bound and "< -1.00 pp" in bound


def test_one_category_dropping_is_named(baseline_night):
    res = _tonight(baseline_night, keep=1, only="math")
    c = _check(res, "category_delta")
    assert not c.passed and "1 of 3 categories dropped more than 3.00 pp: math (40 requests)" in c.detail, c.detail
    assert "code" not in c.detail and "chat" not in c.detail
    moved = res.baseline.arms["candidate"].moved
    assert moved and all(m["category"] == "math" and m["delta"] < 0 for m in moved)
    assert [abs(m["delta"]) for m in moved] == sorted((abs(m["delta"]) for m in moved), reverse=True)


def test_rules_limited_to_some_arms_and_positions(baseline_night):
    rules = [{"check": "per_position_delta", "max_pp": 2.0, "arms": ["control"], "positions": [0, 1, 2]},
             {"check": "per_position_delta", "max_pp": 2.0, "positions": [5, 9]}]
    res = _tonight(baseline_night, keep=3, rules=rules)
    first, second = res.gate.checks
    assert first.passed and first.detail.startswith("control: no position of 3") and "candidate" not in first.detail
    assert not second.passed and "position(s) [9] not drafted (K = 7)" in second.detail
    assert "position(s) 5 dropped" in second.detail


@pytest.mark.parametrize("rule", BASELINE_RULES)
def test_a_baseline_check_without_a_baseline_fails_unless_marked_skip(rule):
    res = synthetic_result(10, rules=[rule, {**rule, "without_baseline": "skip"}])
    failed, skipped = res.gate.checks
    assert not failed.passed and failed.detail.startswith("no baseline given") and "--baseline" in failed.detail
    assert skipped.skipped and not skipped.passed and skipped.detail.startswith("skipped: no baseline given")


def test_an_arm_the_baseline_did_not_run_is_not_compared_and_fails(tmp_path):
    from synthetic import as_baseline, synthetic_arm_config, synthetic_gate, synthetic_run_info
    from qual.harness.build import build_result
    from qual.result import CorpusInfo

    control, candidate = synthetic_pair(6, 0.7, 0.7)
    broken = build_result(
        CorpusInfo("synthetic", "s.jsonl", "sha256:" + "ab" * 32, 6),
        (synthetic_arm_config(1), synthetic_run_info(control), control),
        (synthetic_arm_config(4), synthetic_run_info([], runnable=False, reason="needs GPUs"), []),
        synthetic_gate(NIGHTLY_RULES), seed=0, n_resamples=50,
    )
    res = synthetic_result(pair=(control, candidate), rules=BASELINE_RULES[:1], n_resamples=50,
                           baseline=as_baseline(broken, tmp_path / "result.json"))
    pair = res.baseline.arms
    assert pair["control"].compared and not pair["candidate"].compared
    c = res.gate.checks[0]
    assert not c.passed and "candidate: not compared (the baseline's arm did not run: needs GPUs)" in c.detail


# Shipped profiles the shipped gates set no acceptance floor for, and why (docs/statistics.md, "The shipped gates")
NO_FLOOR = {
    "qwen3-8b-dflash": "a real pair on a GPU: its floor is measured there (never run on this project's CPU machine)",
    "glm-5.3-flash": "a real pair on four GPUs: its floor is measured there (never run on this project's CPU machine)",
}


@pytest.mark.parametrize("gate", ["nightly", "nightly-baseline"])
def test_every_shipped_profile_has_a_floor_or_is_named_without_one(gate):
    """Each shipped gate decides for every shipped profile: an acceptance floor, or none, said here with its reason;
    a new profile, or a floor naming no shipped profile, fails until it is decided. A night of a profile without one
    is skipped by name (test_acceptance_floor)."""
    profiles = {p.stem for p in (NIGHTLY.parents[1] / "models").glob("*.yaml")}  # configs/models, beside the gates
    floors = [r for r in load_gate(NIGHTLY.with_name(f"{gate}.yaml")).rules if r.check == "acceptance_floor"]
    floored = {m for r in floors for m in r.params["models"]}
    assert floored | set(NO_FLOOR) == profiles and not floored & set(NO_FLOOR), (sorted(floored), sorted(profiles))
    assert floored == {"toy", "glm-toy", "glm-toy-vllm"}


@pytest.mark.parametrize(
    "params, passed, words",
    [
        ({"min_rate": 0.3}, True, "control: rate 35.89% >= 30.00%; candidate: rate 35.89% >= 30.00%"),
        ({"min_rate": 0.4}, False, "control: rate 35.89% < 40.00%"),
        ({"min_mean_acceptance_length": 3.6}, False, "mean acceptance length 3.513 < 3.600"),
        ({"min_rate": 0.3, "min_mean_acceptance_length": 3.5, "arms": ["candidate"]}, True, "candidate: rate"),
        ({"min_rate": 0.9, "models": ["glm-5.3-flash"]}, False, "skipped: floors set for model(s) glm-5.3-flash; this run is toy"),
        ({"min_rate": 0.3, "models": ["toy"]}, True, "control: rate"),
    ],
)
def test_acceptance_floor(params, passed, words):
    res = synthetic_result(40, 0.75, 0.75, rules=[{"check": "acceptance_floor", **params}])
    c = res.gate.checks[0]
    assert c.passed is passed and words in c.detail, c.detail
    assert c.skipped is words.startswith("skipped:")  # a rule that does not apply decides nothing
    if params.get("arms") == ["candidate"]:
        assert "control" not in c.detail


@pytest.mark.parametrize(
    "rule, message",
    [
        ({"check": "baseline_delta_lower_bound"}, r"\(baseline_delta_lower_bound\): missing parameter 'min_pp'"),
        ({"check": "baseline_delta_lower_bound", "min_pp": "-1"}, r"\(baseline_delta_lower_bound\): min_pp must be a number"),
        ({"check": "baseline_delta_lower_bound", "min_pp": -1, "confidence": 1.5}, r"\(baseline_delta_lower_bound\): confidence must be"),
        ({"check": "baseline_delta_lower_bound", "min_pp": -1, "arms": ["control", "control"]}, r"\(baseline_delta_lower_bound\): arms must be a non-empty list of distinct arms"),
        ({"check": "baseline_delta_lower_bound", "min_pp": -1, "arms": "control"}, r"arms must be"),
        ({"check": "baseline_delta_lower_bound", "min_pp": -1, "without_baseline": "pass"}, r"\(baseline_delta_lower_bound\): without_baseline must be 'fail' or 'skip', got 'pass'"),
        ({"check": "per_position_delta"}, r"\(per_position_delta\): missing parameter 'max_pp'"),
        ({"check": "per_position_delta", "max_pp": -2}, r"\(per_position_delta\): max_pp must be a number of percentage points >= 0"),
        ({"check": "per_position_delta", "max_pp": 2, "positions": [0, -1]}, r"\(per_position_delta\): positions must be"),
        ({"check": "per_position_delta", "max_pp": 2, "positions": []}, r"\(per_position_delta\): positions must be"),
        ({"check": "per_position_delta", "max_pp": 2, "position": [0]}, r"\(per_position_delta\): unknown parameter\(s\) \['position'\]"),
        ({"check": "category_delta", "max_pp": float("nan")}, r"\(category_delta\): max_pp must be"),
        ({"check": "category_delta", "max_pp": 2, "arms": ["treatment"]}, r"\(category_delta\): arms must be"),
        ({"check": "acceptance_floor"}, r"\(acceptance_floor\): give min_rate, min_mean_acceptance_length or both"),
        ({"check": "acceptance_floor", "min_rate": 30}, r"\(acceptance_floor\): min_rate must be null or a rate in \[0, 1\], got 30"),
        ({"check": "acceptance_floor", "min_mean_acceptance_length": 0.5}, r"\(acceptance_floor\): min_mean_acceptance_length must be"),
        ({"check": "acceptance_floor", "min_rate": 0.1, "models": "toy"}, r"\(acceptance_floor\): models must be"),
        ({"check": "acceptance_floor", "min_rate": 0.1, "floor": 1}, r"\(acceptance_floor\): unknown parameter\(s\) \['floor'\]"),
    ],
)
def test_bad_parameters_of_the_new_checks_name_the_check_and_the_parameter(rule, message):
    with pytest.raises(QualError, match=message):
        parse_rules([{"check": "candidate_runnable"}, rule], "g.yaml")


def test_graph_capture_not_observed_is_skipped_never_guessed():
    """An attached server's capture was not observed: the check neither passes nor fails, and the gate decides on
    the checks it could evaluate."""
    unseen = GraphCapture("not_observed", detail="attached server")
    full = GraphCapture("captured", "FULL", [1, 2, 4, 8])
    for control, candidate, which in [(unseen, unseen, "control and candidate"), (full, unseen, "candidate"),
                                      (unseen, full, "control")]:
        res = synthetic_result(10, control_graph=control, candidate_graph=candidate)
        c = _check(res, "graph_sizes_captured")
        assert c.skipped and not c.passed and f"not observed in {which}" in c.detail
        assert res.gate.passed and c not in res.gate.failed  # the other checks pass: so does the gate
    failing = synthetic_result(30, 0.75, 0.6, control_graph=unseen, candidate_graph=unseen)
    assert not failing.gate.passed and [c.name for c in failing.gate.failed] == [
        "acceptance_delta_lower_bound", "mean_acceptance_length_ratio"]
    only = synthetic_result(5, control_graph=unseen, candidate_graph=unseen, rules=[{"check": "graph_sizes_captured"}])
    assert not only.gate.passed  # a gate that evaluated nothing decided nothing: it does not pass


def test_a_gate_whose_every_check_is_skipped_fails_and_says_why_everywhere(tmp_path, capsys):
    """Skipped checks decide nothing, and a gate that decides nothing fails: the verdict on stdout, summary.md,
    report.html and junit.xml each say so (junit.xml counted no failure, which a CI reads as a pass)."""
    import xml.etree.ElementTree as ET

    from qual.cli.verdict import print_verdict
    from qual.report import write_reports
    from qual.result import DECIDED_NOTHING

    res = synthetic_result(10, rules=[{"check": "acceptance_floor", "min_rate": 0.05, "models": ["nottoy"]}])
    assert not res.gate.passed and res.gate.decided_nothing and res.gate.checks[0].skipped
    assert not synthetic_result(10).gate.decided_nothing
    print_verdict(res, "control", "candidate", tmp_path)
    assert f"  [FAIL] {DECIDED_NOTHING}" in capsys.readouterr().out
    write_reports(res, tmp_path)
    assert DECIDED_NOTHING in (tmp_path / "summary.md").read_text()
    assert DECIDED_NOTHING in (tmp_path / "report.html").read_text()
    suites = ET.parse(tmp_path / "junit.xml").getroot()
    assert (suites.get("tests"), suites.get("failures")) == ("2", "1")
    assert suites.find("testsuite/testcase[@name='gate']/failure").get("message") == DECIDED_NOTHING


# ---------------------------------------------------------------- outcomes: INCONCLUSIVE (an interval that straddles)

DELTA_ONLY = [{"check": "candidate_runnable"}, {"check": "acceptance_delta_lower_bound", "min_pp": -0.5}]


def _replicated(rows, k: int):
    """The same requests k times over (ids made distinct): the variance per request the same, k times the requests."""
    return [replace(r, id=f"{r.id}.{i}") for i in range(k) for r in rows]


def test_an_interval_straddling_its_threshold_is_inconclusive_with_the_requests_that_would_resolve_it():
    """6 requests, one a little worse: the 95% interval [-3.6, 0] pp straddles -0.5 pp. Neither a pass nor a
    regression: INCONCLUSIVE, with the requests that would resolve it at this variance."""
    res = synthetic_result(6, 0.75, 0.745, rules=DELTA_ONLY)
    c = _check(res, "acceptance_delta_lower_bound")
    assert (c.outcome, c.passed, res.gate.outcome, res.gate.passed) == ("inconclusive", False, "inconclusive", False)
    lo, hi = res.comparison.delta_rate_ci95
    assert lo * 100 < -0.5 <= hi * 100 and c.value == pytest.approx(lo * 100)
    assert c.needed_requests is not None and c.needed_requests > 6
    assert "inconclusive at 6 requests (about" in c.detail and f"{c.needed_requests} requests would resolve it" in c.detail


@pytest.mark.parametrize("n, p_candidate, seed", [(30, 0.745, 0), (30, 0.74, 1), (40, 0.745, 2), (24, 0.742, 0)])
def test_the_requests_named_do_resolve_it(n, p_candidate, seed):
    """The estimate holds the variance per request fixed: the same requests replicated (their variance per request
    unchanged) to twice the number named resolve the check, on the side its point lies (a pass above the threshold, a
    failure below)."""
    control, candidate = synthetic_pair(n, 0.75, p_candidate, seed=seed)
    res = synthetic_result(pair=(control, candidate), rules=DELTA_ONLY)
    c = _check(res, "acceptance_delta_lower_bound")
    assert c.outcome == "inconclusive" and c.needed_requests > n
    k = 2 * -(-c.needed_requests // n)
    more = synthetic_result(pair=(_replicated(control, k), _replicated(candidate, k)), rules=DELTA_ONLY)
    side = "pass" if res.comparison.delta_rate * 100 >= -0.5 else "fail"
    assert _check(more, "acceptance_delta_lower_bound").outcome == side, more.comparison.delta_rate_ci95


def test_no_number_of_requests_moves_a_point_on_its_threshold_or_an_interval_without_width():
    from qual.gate import needed_requests

    assert needed_requests(-0.01, 0.0, -0.005, -0.005, 40) is None  # the point on the threshold
    assert needed_requests(-0.005, -0.005, -0.005, -0.005, 40) is None
    assert needed_requests(-0.02, 0.0, -0.01, -0.005, 40) == 160  # (0.01 / 0.005)^2 x 40


def test_precedence_and_what_inconclusive_exits_with():
    """FAIL > INCONCLUSIVE > PASS; the gate file's `inconclusive: pass` makes an INCONCLUSIVE gate exit 0, never a
    failing one."""
    from qual.result import CheckResult, gate_outcome

    ok, unsure, bad, skip = (CheckResult("a", True, ""), CheckResult("b", False, "", inconclusive=True),
                             CheckResult("c", False, ""), CheckResult("d", False, "", skipped=True))
    assert [gate_outcome(cs) for cs in ([ok], [ok, unsure], [ok, unsure, bad], [unsure, skip], [skip], [])] == [
        "pass", "inconclusive", "fail", "inconclusive", "fail", "fail"]
    relaxed = {"inconclusive": "pass", "rules": DELTA_ONLY}
    assert synthetic_result(6, 0.75, 0.745, rules=relaxed).gate.passed is True
    failing = {"inconclusive": "pass", "rules": [*DELTA_ONLY, {"check": "mean_acceptance_length_ratio", "min": 0.99}]}
    res = synthetic_result(6, 0.75, 0.745, rules=failing)
    assert (res.gate.outcome, res.gate.passed) == ("fail", False)
    with pytest.raises(QualError, match=r"g\.yaml: inconclusive must be 'fail' \(exit 1, the default\) or 'pass' "
                                        r"\(exit 0\): what a gate whose outcome is INCONCLUSIVE exits with, got 'maybe'"):
        parse_rules({"inconclusive": "maybe", "rules": DELTA_ONLY}, "g.yaml")


def test_inconclusive_is_said_wherever_fail_is(tmp_path, capsys):
    import xml.etree.ElementTree as ET

    from qual.cli.verdict import print_verdict
    from qual.report import write_reports

    res = synthetic_result(6, 0.75, 0.745, rules=DELTA_ONLY)
    print_verdict(res, "control", "candidate", tmp_path)
    out = capsys.readouterr().out
    assert out.startswith("INCONCLUSIVE: ") and "  [INCONCLUSIVE] acceptance_delta_lower_bound: " in out
    assert "exits 1" in out and "never a series' last pass" in out
    write_reports(res, tmp_path)
    assert (tmp_path / "summary.md").read_text().startswith("## ⚠️ INCONCLUSIVE")
    html = (tmp_path / "report.html").read_text()
    assert '<section class="verdict inconclusive">' in html and "<td class=\"bad\">INCONCLUSIVE</td>" in html
    failure = ET.parse(tmp_path / "junit.xml").getroot().find(".//failure")
    assert failure.get("type") == "GateCheckInconclusive" and failure.get("message").startswith("inconclusive: ")
    data = json.loads((tmp_path / "result.json").read_text())
    assert (data["gate"]["passed"], data["gate"]["outcome"], data["gate"]["inconclusive"]) == (False, "inconclusive", "fail")
    check = next(c for c in data["gate"]["checks"] if c["name"] == "acceptance_delta_lower_bound")
    assert check["inconclusive"] and check["needed_requests"] > 6


# ---------------------------------------------------------------- numbers beside the prose


OPS = {">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "<=": lambda a, b: a <= b}


@pytest.mark.parametrize("p_candidate", [0.75, 0.68])
def test_every_check_carries_numbers_that_decide_as_it_did(tmp_path, p_candidate):
    """value op threshold is the check's verdict (where it was decided on one number), for a check over both arms each
    arm's; a unit names what the numbers are. Nightly-baseline's every rule, tonight against a baseline, passing and
    failing."""
    import yaml

    from synthetic import as_baseline

    rules = yaml.safe_load(default_gate().with_name("nightly-baseline.yaml").read_text())["rules"]
    rules = [{**r, "models": None} if r["check"] == "acceptance_floor" else r for r in rules]
    base = as_baseline(synthetic_result(40, 0.75, 0.75), tmp_path / "base" / "result.json")
    res = synthetic_result(40, 0.75, p_candidate, rules=rules, baseline=base)
    assert {c.name for c in res.gate.checks} == set(CHECKS)
    for c in res.gate.checks:
        numbers = [c.per_arm[arm] for arm in c.per_arm] or [dict(value=c.value, threshold=c.threshold, op=c.op,
                                                                 unit=c.unit)]
        assert all(n["unit"] and n["op"] in OPS for n in numbers), c
        decided = [OPS[n["op"]](n["value"], n["threshold"]) for n in numbers if n["value"] is not None]
        assert decided, c
        if c.outcome != "inconclusive" and c.name != "acceptance_delta_lower_bound":
            assert all(decided) is c.passed, c
        if c.name in ("baseline_delta_lower_bound", "per_position_delta", "category_delta", "acceptance_floor"):
            assert set(c.per_arm) == {"control", "candidate"}, c


# ---------------------------------------------------------------- the gate file's model and its JSON Schema


def test_the_gate_schema_is_the_model_qual_validates_with():
    """`qual schema --gate` is generated from the model parse_rules validates with: the shipped gates are valid
    against it, and what parse_rules refuses it refuses too."""
    import jsonschema
    import yaml

    from qual.gate_rules import gate_schema

    schema = gate_schema()
    assert schema["$id"] == "qual.gate/1"
    validator = jsonschema.Draft202012Validator(schema)
    for gate in default_gate().parent.glob("*.yaml"):
        validator.validate(yaml.safe_load(gate.read_text()))
    for bad in ({"rules": [{"check": "nope"}]}, {"rules": []}, {"rules": [{"check": "category_delta"}]},
                {"inconclusive": "maybe", "rules": DELTA_ONLY}, {"rules": DELTA_ONLY, "extra": 1},
                {"rules": [{"check": "acceptance_delta_lower_bound", "min_pp": True}]}):
        with pytest.raises(QualError):
            parse_rules(bad, "g.yaml")
        assert not validator.is_valid(bad), bad
    assert validator.is_valid(DELTA_ONLY) and parse_rules(DELTA_ONLY).rules[1].params == {"min_pp": -0.5,
                                                                                          "confidence": 0.95}


def test_qual_schema_gate_prints_it(capsys):
    from cli_inprocess import qual_in

    from qual.gate_rules import gate_schema

    proc = qual_in(capsys, "schema", "--gate")
    assert proc.returncode == 0 and json.loads(proc.stdout) == gate_schema()
    proc = qual_in(capsys, "schema", "--gate", "--sweep")
    assert proc.returncode == 2 and "one schema at a time" in proc.stderr
