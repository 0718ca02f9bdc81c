"""Latency records and their per-arm summary: the embedded runtime times every request around its own steps (without
changing a token), the records are checked when read back, and percentiles are numpy's linear interpolation."""

from dataclasses import replace

import numpy as np
import pytest

from latency_checks import assert_latency_consistent
from runtime_helpers import prompts
from synthetic import synthetic_request
from qual.latency import decode_span, latency_summary, percentiles
from qual.records import RecordError, RequestResult, measured_latency
from qual.runtime.config import CacheConfig, EngineConfig, SamplingParams
from qual.runtime.engine import LLMEngine


def timed(r: RequestResult, step_times, end, admitted=None, in_steps=None) -> RequestResult:
    """r with a latency record: arrival at 0, its steps' tokens at step_times, finished at end."""
    return replace(r, latency=measured_latency(0.0, step_times, end, len(r.output_token_ids), admitted, in_steps))


# -- the record ------------------------------------------------------------------------------------------------------

def test_a_record_from_its_times():
    lat = measured_latency(10.0, [10.5, 10.7, 11.5], 11.6, 9, admitted=10.25)
    assert lat == {"ttft_s": 0.5, "tpot_s": 0.125, "e2e_s": 1.6, "queued_s": 0.25, "step_times_s": [0.5, 0.7, 1.5],
                   "decode_steps_s": 1.0}
    one = measured_latency(0.0, [0.2], 0.2, 1)
    assert one["tpot_s"] is None and one["decode_steps_s"] is None
    whole = measured_latency(0.0, [], 0.9, 5)  # an unstreamed reply: its end alone
    assert whole["ttft_s"] is None and whole["tpot_s"] is None and whole["e2e_s"] == 0.9
    assert measured_latency(0.0, [0.5, 0.7, 1.5], 1.5, 9, decode_steps_s=0.6)["decode_steps_s"] == 0.6


def test_a_record_no_engine_writes_is_refused_when_read_back():
    r = timed(synthetic_request("a", [2, 1, 0]), [0.5, 0.6, 0.7, 0.8], 0.9)
    RequestResult.from_json(r.to_json())
    for change, what in [({"ttft_s": 0.4}, "ttft_s"), ({"e2e_s": 0.75}, "step_times_s"),
                         ({"step_times_s": [0.5, 0.7, 0.6, 0.8]}, "step_times_s"), ({"e2e_s": -1.0}, "e2e_s"),
                         ({"decode_steps_s": 0.5}, "decode_steps_s"), ({"tpot_s": "fast"}, "tpot_s")]:
        bad = r.to_json()
        bad["latency"] = {**bad["latency"], **change}
        with pytest.raises(RecordError, match=what):
            RequestResult.from_json(bad)
    bad = r.to_json()
    bad["latency"] = {**bad["latency"], "extra": 1}
    with pytest.raises(RecordError, match="exactly"):
        RequestResult.from_json(bad)
    old = r.to_json()
    del old["latency"]  # written before qual timed requests
    assert RequestResult.from_json(old).latency is None


# -- the summary -----------------------------------------------------------------------------------------------------

def test_percentiles_are_numpys_linear_interpolation():
    values = [0.1, 0.4, 0.2, 0.9, 0.3]
    p = percentiles(values)
    assert (p["p50"], p["p90"], p["p99"]) == tuple(np.percentile(values, [50, 90, 99]))
    assert p["p90"] == pytest.approx(0.9 - 0.4 * (0.9 - 0.4))  # rank 3.6 of 0..4: between 0.4 and 0.9
    assert p["n"] == 5 and p["mean"] == pytest.approx(0.38)
    assert percentiles([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_an_arms_summary():
    a = timed(synthetic_request("a", [1, 1]), [1.0, 2.0, 3.0], 3.0, admitted=0.5, in_steps=1.5)  # 5 tokens, 3 steps
    b = timed(synthetic_request("b", [3]), [2.0, 2.5], 2.5, admitted=1.0)  # 5 tokens, 2 steps
    s = latency_summary([a, b, synthetic_request("untimed", [0])])
    assert decode_span(a) == (4, 2.0, 2, 1.5) and decode_span(b) == (4, 0.5, 1, 0.5)
    assert s["ttft_s"]["n"] == 2 and s["ttft_s"]["p50"] == 1.5
    assert s["e2e_s"]["mean"] == 2.75 and s["queued_s"]["p50"] == 0.75
    assert s["decode_tokens_per_second"] == pytest.approx(8 / 2.5)  # tokens after the first / first-to-last seconds
    assert s["step_s"] == pytest.approx((1.5 + 0.5) / 3) and s["decode_steps"] == 3
    assert s["percentile_method"] == "linear"
    assert latency_summary([synthetic_request("untimed", [0])]) is None


# -- the embedded runtime ----------------------------------------------------------------------------------------------

def generate(target, draft, **over):
    """Eight requests of different lengths, three at a time (the rest wait), at the static shapes that decode ahead
    and two steps a launch."""
    cfg = EngineConfig(str(target), str(draft) if draft else None, cache=CacheConfig(block_size=4, memory_bytes=2**22),
                       dtype="float64", max_model_len=128, max_num_seqs=3, **over)
    reqs = [replace(r, max_tokens=m) for r, m in zip(prompts(8), (20, 7, 13, 20, 3, 16, 9, 20))]
    with LLMEngine(cfg) as engine:
        return engine.generate(reqs, SamplingParams(temperature=0.0, seed=7, max_tokens=20))


@pytest.mark.slow
@pytest.mark.parametrize("over", [{}, {"static_shapes": True, "async_decode": True, "steps_per_launch": 2}],
                         ids=["step-by-step", "ahead-two-steps-a-launch"])
def test_the_runtime_times_every_request_around_its_steps(tiny_pair, over):
    target, draft = tiny_pair
    speculative, plain = generate(target, draft, **over), generate(target, None, **over)
    untimed = generate(target, draft)
    for r in untimed:  # what a run computes is what it computed before it was timed: no token moves
        r.latency = None
    assert [replace(r, latency=None) for r in speculative] == untimed
    assert [r.output_token_ids for r in plain] == [r.output_token_ids for r in speculative]  # greedy: lossless
    for r in speculative + plain:
        assert_latency_consistent(r)
        RequestResult.from_json(r.to_json())  # as a journal reads it back
    for r in speculative:  # a step a verify: the prefill's token, then one time per draft step
        assert len(r.latency["step_times_s"]) == 1 + r.drafts
    for r in plain:  # a token a step
        assert len(r.latency["step_times_s"]) == len(r.output_token_ids)
    queued = [r.latency["queued_s"] for r in speculative]
    assert max(queued[:3]) < min(queued[3:])  # three at a time: the others waited for a slot
    assert all(r.latency["ttft_s"] >= r.latency["queued_s"] for r in speculative)
