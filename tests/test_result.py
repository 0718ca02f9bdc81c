"""The Result object and result.json (schema "qual.result/1"): contract keys, round trip, errors."""

from __future__ import annotations

import json

import pytest

from qual.errors import QualError
from qual.harness.build import build_result
from qual.result import SCHEMA, load_result, save_result
from synthetic import synthetic_arm_config, synthetic_gate, synthetic_pair, synthetic_result, synthetic_run_info

# The result.json contract: these keys are never renamed.
CONTRACT = {
    "": ["schema", "corpus", "arms", "comparison", "gate", "created_at", "qual_version", "reproduce"],
    "corpus": ["name", "path", "fingerprint", "count"],
    "arm": ["config", "acceptance", "per_request", "graph_capture", "throughput", "engine_version", "runnable"],
    "config": ["engine", "model", "dcp", "tp", "draft_kv", "target_path", "draft_path", "sampling"],
    "acceptance": ["rate", "mean_acceptance_length", "drafts", "draft_tokens", "accepted_tokens",
                   "per_position", "per_position_conditional"],
    "per_request": ["id", "category", "prompt_token_ids", "output_token_ids", "drafts", "draft_tokens",
                    "accepted_tokens", "accepted_per_position"],
    "graph_capture": ["status", "sizes", "mode", "seconds", "bytes"],
    "throughput": ["wall_seconds", "output_tokens", "tokens_per_second"],
    "comparison": ["delta_rate", "delta_rate_ci95", "delta_mean_acceptance_length", "target_outputs_identical",
                   "output_divergence", "proposal_divergence", "per_category", "per_request_deltas", "per_position"],
    "gate": ["passed", "checks"],
    "check": ["name", "passed", "detail"],
}


def _strict(text: str) -> dict:
    def reject(c):
        raise AssertionError(f"non-standard JSON constant {c}")

    return json.loads(text, parse_constant=reject)


def test_result_json_has_every_contract_key(tmp_path):
    res = synthetic_result(20, 0.75, 0.7)
    data = _strict(save_result(res, tmp_path / "result.json").read_text())
    assert data["schema"] == SCHEMA == "qual.result/1"
    assert set(CONTRACT[""]) <= set(data)
    assert set(CONTRACT["corpus"]) <= set(data["corpus"])
    for arm in ("control", "candidate"):
        a = data["arms"][arm]
        assert set(CONTRACT["arm"]) <= set(a)
        assert set(CONTRACT["config"]) <= set(a["config"])
        assert set(CONTRACT["acceptance"]) <= set(a["acceptance"])
        assert set(CONTRACT["per_request"]) <= set(a["per_request"][0])
        assert set(CONTRACT["graph_capture"]) <= set(a["graph_capture"])
        assert set(CONTRACT["throughput"]) <= set(a["throughput"])
    cmp = data["comparison"]
    assert set(CONTRACT["comparison"]) <= set(cmp)
    assert len(cmp["delta_rate_ci95"]) == 2 and cmp["delta_rate_ci95"][0] <= cmp["delta_rate"] <= cmp["delta_rate_ci95"][1]
    assert {"overall", "per_position"} <= set(cmp["proposal_divergence"])
    assert {"category", "n", "control_rate", "candidate_rate", "delta"} <= set(cmp["per_category"][0])
    assert [p["position"] for p in cmp["per_position"]] == list(range(7))
    keys = {"control", "candidate", "delta", "ci", "control_ci", "candidate_ci", "conditional_ci"}
    assert keys <= set(cmp["per_position"][0])
    assert set(CONTRACT["gate"]) <= set(data["gate"])
    assert set(CONTRACT["check"]) <= set(data["gate"]["checks"][0])
    assert data["arms"]["control"]["config"]["dcp"] == 1 and data["arms"]["candidate"]["config"]["dcp"] == 4


def test_round_trip(tmp_path):
    res = synthetic_result(15, 0.75, 0.7)
    path = save_result(res, tmp_path / "out" / "result.json")
    back = load_result(path)
    assert back.to_json() == res.to_json()
    assert back.verdict == res.verdict == "fail"
    assert back.comparison.ci_at(0.95) == tuple(res.comparison.delta_rate_ci95)
    assert not (tmp_path / "out" / "result.json.tmp").exists()


def test_load_errors(tmp_path):
    res = synthetic_result(5)
    data = res.to_json()
    bad_schema = tmp_path / "a.json"
    bad_schema.write_text(json.dumps({**data, "schema": "qual.result/99"}))
    with pytest.raises(QualError, match=r"a\.json: unsupported result schema 'qual.result/99'"):
        load_result(bad_schema)
    broken = tmp_path / "b.json"
    broken.write_text('{\n "schema": "qual.result/1",\n oops\n}')
    with pytest.raises(QualError, match=r"b\.json:3: invalid JSON"):
        load_result(broken)
    missing = tmp_path / "c.json"
    missing.write_text(json.dumps({k: v for k, v in data.items() if k != "arms"}))
    with pytest.raises(QualError, match="malformed result"):
        load_result(missing)
    with pytest.raises(QualError, match="cannot read"):
        load_result(tmp_path / "none.json")


def test_candidate_order_follows_control_and_replay_is_checked():
    control, candidate = synthetic_pair(6, 0.7, 0.7)
    gate = synthetic_gate()
    arms = lambda c, k: (  # noqa: E731
        (synthetic_arm_config(1), synthetic_run_info(c), c),
        (synthetic_arm_config(4), synthetic_run_info(k), k),
    )
    res = build_result(_corpus(6), *arms(control, list(reversed(candidate))), gate, seed=0, n_resamples=50)
    assert [r.id for r in res.candidate.per_request] == [r.id for r in res.control.per_request]
    assert res.comparison.delta_rate == 0.0
    with pytest.raises(QualError, match="did not replay the same requests"):
        build_result(_corpus(6), *arms(control, candidate[:5]), gate, seed=0, n_resamples=50)


def test_nan_never_reaches_json():
    res = synthetic_result(5)
    res.candidate.throughput.tokens_per_second = float("nan")
    assert _strict(json.dumps(res.to_json()))["arms"]["candidate"]["throughput"]["tokens_per_second"] is None


def _corpus(n):
    from qual.result import CorpusInfo

    return CorpusInfo("s", "s.jsonl", "sha256:00", n)


def test_throughput_generate_seconds_is_optional(tmp_path):
    """result.json files from before generate_seconds load (None); with it, generation tok/s excludes start-up."""
    res = synthetic_result(5)
    data = res.to_json()
    for arm in data["arms"].values():
        del arm["throughput"]["generate_seconds"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_result(tmp_path / "old.json")
    assert old.control.throughput.generate_seconds is None and old.control.throughput.generate_tokens_per_second is None
    res.control.throughput.generate_seconds = res.control.throughput.wall_seconds / 4
    back = load_result(save_result(res, tmp_path / "new" / "result.json"))
    t = back.control.throughput
    assert t.generate_tokens_per_second == pytest.approx(4 * t.tokens_per_second)


# result.json's `baseline` key (only with `qual run --baseline`): extend, never rename.
BASELINE_CONTRACT = {
    "": ["ref", "chosen_by", "history_id", "result_path", "created_at", "configuration", "differs", "arms", "trend"],
    "arm": ["compared", "n_requests", "retokenized", "baseline_rate", "tonight_rate", "delta_rate", "delta_rate_ci",
            "baseline_mean_acceptance_length", "tonight_mean_acceptance_length", "delta_mean_acceptance_length",
            "per_position", "per_category", "moved"],
    "position": ["position", "baseline", "tonight", "delta", "ci"],
}


def test_the_baseline_key_is_written_only_with_a_baseline(tmp_path):
    from synthetic import as_baseline

    plain = _strict(save_result(synthetic_result(8), tmp_path / "plain.json").read_text())
    assert "baseline" not in plain
    base = as_baseline(synthetic_result(8, created_at="2026-11-30T02:00:00+00:00"), tmp_path / "base" / "result.json")
    data = _strict(save_result(synthetic_result(8, baseline=base), tmp_path / "result.json").read_text())
    b = data["baseline"]
    assert set(BASELINE_CONTRACT[""]) <= set(b) and set(b["arms"]) == {"control", "candidate"}
    for arm in b["arms"].values():
        assert set(BASELINE_CONTRACT["arm"]) <= set(arm) and arm["compared"] is True
        assert set(BASELINE_CONTRACT["position"]) <= set(arm["per_position"][0])
    assert set(plain) | {"baseline"} == set(data)  # nothing else changes
