"""Records read back from files obey what every engine's records obey (qual.records.check_record)."""

from __future__ import annotations

import pytest

from qual.records import RecordError, RequestResult, check_record
from synthetic import synthetic_pair, synthetic_request


def _good() -> dict:
    # 3 verify steps accepting 2, 0, 3 of K=3 drafts: 1 + (3 + 1 + 4) = 9 tokens, the last step cut to 2
    return synthetic_request("r1", [2, 0, 3], k=3).to_json() | {"output_token_ids": list(range(7))}


def test_engine_made_and_synthetic_records_pass():
    check_record(RequestResult.from_json(_good(), 3))
    control, candidate = synthetic_pair(20, 0.8, 0.6, k=4)
    for rec in control + candidate:
        check_record(RequestResult.from_json(rec.to_json(), 4))
    no_drafter = _good() | {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": [],
                            "draft_steps": []}
    check_record(RequestResult.from_json(no_drafter))  # without a drafter any length is possible


IMPOSSIBLE = [  # (change to a good record, words naming the field)
    ({"accepted_tokens": 10, "accepted_per_position": [3, 3, 4]}, "accepted_tokens 10 > draft_tokens 9"),
    ({"accepted_per_position": [2, 3, 0]}, "accepted_per_position[1] 3 > [0] 2"),
    ({"accepted_per_position": [3, 1, 0]}, "accepted_per_position sums to 4, accepted_tokens is 5"),
    ({"draft_tokens": 8}, "draft_tokens 8 != drafts 3 x 3 positions"),
    ({"accepted_per_position": [4, 1, 0], "accepted_tokens": 5}, "accepted_per_position[0] 4 > drafts 3"),
    ({"output_token_ids": list(range(10))}, "10 output tokens cannot come from 3 verify steps accepting 5 drafts"),
    ({"output_token_ids": [1, 2, 3]}, "3 output tokens cannot come from 3 verify steps"),
    ({"output_token_ids": []}, "output_token_ids is empty"),
    ({"drafts": -1}, "drafts must be an integer >= 0"),
    ({"drafts": True}, "drafts must be an integer >= 0"),
    ({"output_token_ids": [1, -2, 3]}, "output_token_ids must be a list"),
    ({"finish_reason": "abort"}, "finish_reason 'abort' is not one of length, stop"),
    ({"draft_steps": [[1, [0, 0, 0]]]}, "draft_steps has 1 steps, drafts is 3"),
    ({"top2_margins": [0.5]}, "top2_margins must hold one margin per output token"),
    ({"colour": "red"}, "unknown field 'colour'"),
]


@pytest.mark.parametrize("change,words", IMPOSSIBLE, ids=[w.split(" ")[0] for _, w in IMPOSSIBLE])
def test_impossible_records_are_refused_naming_record_and_field(change, words):
    with pytest.raises(RecordError, match="^request r1: ") as err:
        RequestResult.from_json(_good() | change, 3)
    assert words in str(err.value)


def test_a_record_drafting_another_k_than_its_arm_is_refused():
    with pytest.raises(RecordError, match="accepted_per_position has 3 positions, the arm drafts 7"):
        RequestResult.from_json(_good(), 7)
    with pytest.raises(RecordError, match="missing field 'drafts'"):
        RequestResult.from_json({k: v for k, v in _good().items() if k != "drafts"})
