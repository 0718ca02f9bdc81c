"""Gate rules: parsing and validation, and each check on synthetic results (qual.gate)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from qual.records import GraphCapture
from qual.errors import QualError
from qual.paths import DEFAULT_GATE
from qual.gate import CHECKS, evaluate, load_gate, parse_rules
from synthetic import NIGHTLY_RULES, synthetic_pair, synthetic_request, synthetic_result

NIGHTLY = DEFAULT_GATE


def _check(result, name):
    (c,) = [c for c in result.gate.checks if c.name == name]
    return c


def test_nightly_gate_file_loads():
    gate = load_gate(NIGHTLY)
    assert [r.check for r in gate.rules] == [
        "candidate_runnable", "acceptance_delta_lower_bound", "mean_acceptance_length_ratio",
        "target_outputs_identical", "graph_sizes_captured",
    ]
    assert gate.rules[1].params == {"min_pp": -0.5, "confidence": 0.95}
    assert set(r.check for r in gate.rules) == set(CHECKS)


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
        synthetic_gate([{"check": "target_outputs_identical", "when_temperature": 0}]),
        seed=0,
        n_resamples=50,
    )
    assert res.gate.passed and res.gate.checks[0].detail.startswith("skipped: temperature 0.8")


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
