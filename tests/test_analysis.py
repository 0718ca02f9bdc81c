"""`qual.load`: a run's result.json as pandas tables, each row checked against the records it came from; pandas is
loaded by the first table, never by `import qual` or the command line."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

import qual
from qual.errors import QualError
from qual.result import Result, save_result
from qual.sweep_result import SweepResult, save_sweep
from synthetic import synthetic_result


def _close(a, b) -> bool:
    return (a is None and math.isnan(b)) or (a is not None and b == pytest.approx(a))


@pytest.fixture
def single(tmp_path) -> Path:
    save_result(synthetic_result(6, 0.75, 0.5), tmp_path / "run" / "result.json")
    return tmp_path / "run"


def test_a_run_directory_loads_with_a_row_per_request_position_category_and_latency(single):
    run = qual.load(single)
    result: Result = run.result
    assert not run.is_sweep and list(run.arms) == ["control", "candidate"]
    requests = run.requests
    assert len(requests) == sum(len(a.per_request) for a in result.arms.values())
    for arm, a in result.arms.items():
        rows = requests[requests.arm == arm].set_index("id")
        for q in a.per_request:
            row = rows.loc[q.id]
            assert (row.drafts, row.draft_tokens, row.accepted_tokens) == (q.drafts, q.draft_tokens, q.accepted_tokens)
            assert _close(q.counts.rate, row.rate) and row.output_tokens == len(q.output_token_ids)
        acc = a.acceptance.to_json()
        positions = run.positions[run.positions.arm == arm]
        assert list(positions.accepted) == acc["accepted_per_position"]
        assert all(_close(x, y) for x, y in zip(acc["per_position"], positions.rate))
        summary = run.summary.set_index("arm").loc[arm]
        assert _close(acc["rate"], summary.rate) and summary.requests == len(a.per_request)
    # the arm's rate is the ratio of sums of its requests' counts, recomputed from the table
    by_arm = requests.groupby("arm")[["accepted_tokens", "draft_tokens"]].sum()
    assert (by_arm.accepted_tokens / by_arm.draft_tokens).to_dict() == pytest.approx(run.summary.set_index("arm").rate
                                                                                    .to_dict())
    categories = run.categories
    assert categories.drop(columns="candidate").to_dict("records") == result.comparison.per_category
    assert set(categories.candidate) == {"candidate"} and run.turns.empty  # requests of one turn


def test_latency_is_a_row_per_arm_and_metric(tmp_path):
    """Each request timed (a step a token, 10 ms apart, after 50 ms to the first): the arms' percentiles as rows."""
    from dataclasses import replace

    from qual.latency import latency_summary
    from qual.records import measured_latency

    result = synthetic_result(6, 0.75, 0.5)
    for arm in (result.control, result.candidate):
        arm.per_request = [replace(q, latency=measured_latency(0.0, [0.05 + 0.01 * i for i in range(len(q.output_token_ids))],
                                                               0.06 + 0.01 * len(q.output_token_ids),
                                                               len(q.output_token_ids)))
                           for q in arm.per_request]
        arm.latency = latency_summary(arm.per_request)
    run = qual.load(save_result(result, tmp_path / "result.json"))
    timed = {arm: a.latency for arm, a in run.arms.items() if a.latency}
    assert timed and len(run.latency) == 4 * len(timed)
    for row in run.latency.itertuples():
        expected = timed[row.arm][row.metric]
        assert row.n == expected["n"] and _close(expected["p50"], row.p50)


def test_a_sweep_loads_with_its_candidates_by_name(tmp_path):
    one, two = synthetic_result(6, 0.75, 0.7), synthetic_result(6, 0.75, 0.4)
    sweep = SweepResult.of([("candidate-dcp2", one), ("candidate-dcp4", Result(**{**one.__dict__, "candidate": two.candidate,
                                                                                    "comparison": two.comparison}))])
    save_sweep(sweep, tmp_path / "result.json")
    run = qual.load(tmp_path / "result.json")
    assert run.is_sweep and list(run.arms) == ["control", "candidate-dcp2", "candidate-dcp4"]
    assert set(run.requests.arm) == set(run.arms) and set(run.categories.candidate) == {"candidate-dcp2",
                                                                                         "candidate-dcp4"}
    assert "sweep of 2 candidates" in repr(run)


def test_what_is_not_a_result_is_refused_by_name(tmp_path):
    (tmp_path / "result.json").write_text('{"schema": "something/1"}')
    with pytest.raises(QualError, match="schema"):
        qual.load(tmp_path)


def test_import_qual_and_the_command_line_do_not_load_pandas():
    code = ("import sys, qual; from qual.cli.main import _register, run_app; _register(); "
            "run_app(['run', '--help']); print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(Path(qual.__file__).parents[1]), "COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("False")
