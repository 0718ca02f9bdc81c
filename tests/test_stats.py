"""Acceptance math, paired bootstrap and divergence measures (qual.stats)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from qual.errors import QualError
from qual.records import measured_latency
from qual.stats import (
    acceptance_summary,
    common_prefix_length,
    compare_outputs,
    decode_speedup,
    pair_by_id,
    pair_requests,
    paired_bootstrap,
    per_category,
    per_request_deltas,
    per_turn,
    proposal_divergence,
)
from synthetic import synthetic_pair, synthetic_request


def test_acceptance_hand_example():
    # Accepted lengths 3, 0, 7 and 1 with K = 7: 4 drafts, 28 draft tokens, 11 accepted.
    reqs = [synthetic_request("a", [3, 0, 7]), synthetic_request("b", [1])]
    acc = acceptance_summary(reqs)
    assert (acc.drafts, acc.draft_tokens, acc.accepted_tokens) == (4, 28, 11)
    assert acc.rate == pytest.approx(11 / 28)
    assert acc.mean_acceptance_length == pytest.approx(1 + 11 / 4)
    # Reached position i: lengths > i -> [3, 2, 2, 1, 1, 1, 1].
    assert acc.accepted_per_position == [3, 2, 2, 1, 1, 1, 1]
    assert acc.per_position == pytest.approx([3 / 4, 2 / 4, 2 / 4, 1 / 4, 1 / 4, 1 / 4, 1 / 4])
    assert acc.per_position_conditional == pytest.approx([3 / 4, 2 / 3, 1.0, 1 / 2, 1.0, 1.0, 1.0])
    # Conditional position 0 is the unconditional one; unconditional rates multiply out of conditional ones.
    prod = 1.0
    for uncond, cond in zip(acc.per_position, acc.per_position_conditional):
        prod *= cond
        assert prod == pytest.approx(uncond)
    # Accepted tokens = sum over positions of the accepted-at-position counts.
    assert sum(acc.accepted_per_position) == acc.accepted_tokens


def test_conditional_undefined_after_a_position_nobody_reached():
    acc = acceptance_summary([synthetic_request("a", [1, 0, 1], k=4)])
    assert acc.per_position == pytest.approx([2 / 3, 0.0, 0.0, 0.0])
    assert acc.per_position_conditional[0] == pytest.approx(2 / 3)
    assert acc.per_position_conditional[1] == 0.0
    assert acc.per_position_conditional[2:] == [None, None]


def test_zero_drafts_is_undefined_not_zero():
    no_drafter = synthetic_request("a", [])
    acc = acceptance_summary([no_drafter])
    assert acc.rate is None and acc.mean_acceptance_length is None
    assert acc.per_position == [None] * 7 and acc.per_position_conditional == [None] * 7
    assert acceptance_summary([]).per_position == []
    boot = paired_bootstrap([no_drafter], [no_drafter], n_resamples=50)
    assert boot.delta_rate is None and boot.delta_rate_ci[0.95] is None


def test_identical_arms_delta_zero_and_degenerate_ci():
    control, candidate = synthetic_pair(50, 0.7, 0.7, seed=3)
    boot = paired_bootstrap(control, candidate, n_resamples=300, seed=1)
    assert boot.delta_rate == 0.0
    assert boot.delta_rate_ci[0.95] == (0.0, 0.0)
    assert boot.delta_mean_acceptance_length == 0.0


def test_bootstrap_ci_contains_estimate_and_shrinks_with_more_prompts():
    widths = []
    for n in (30, 480):
        control, candidate = synthetic_pair(n, 0.75, 0.70, seed=7)
        boot = paired_bootstrap(control, candidate, n_resamples=1000, seed=0, confidences=(0.9, 0.95))
        lo, hi = boot.delta_rate_ci[0.95]
        assert lo <= boot.delta_rate <= hi
        lo90, hi90 = boot.delta_rate_ci[0.9]
        assert lo <= lo90 <= hi90 <= hi  # a lower confidence gives a narrower interval
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2  # ~1/sqrt(16) = 1/4 in expectation


def test_bootstrap_is_seeded_and_paired():
    control, candidate = synthetic_pair(40, 0.75, 0.72, seed=2)
    a = paired_bootstrap(control, candidate, n_resamples=400, seed=11)
    b = paired_bootstrap(control, candidate, n_resamples=400, seed=11)
    c = paired_bootstrap(control, candidate, n_resamples=400, seed=12)
    assert a.delta_rate_ci == b.delta_rate_ci
    assert a.delta_rate_ci != c.delta_rate_ci
    # Common random numbers make every request drop: a paired CI stays below zero.
    assert a.delta_rate_ci[0.95][1] < 0


def test_pair_requests_reorders_and_verifies():
    control, candidate = synthetic_pair(4, 0.7, 0.7)
    c, k = pair_requests(control, list(reversed(candidate)))
    assert [r.id for r in k] == [r.id for r in c]
    with pytest.raises(QualError, match="same requests"):
        pair_requests(control, candidate[:-1])
    with pytest.raises(QualError, match="duplicate"):
        pair_requests(control + control[:1], candidate)
    bad = list(candidate)
    bad[1] = synthetic_request(bad[1].id, [1], prompt_len=9)
    with pytest.raises(QualError, match="prompt token ids differ"):
        pair_requests(control, bad)


def test_per_category_and_per_request_deltas():
    control = [
        synthetic_request("a", [7, 7], category="x"),  # 14/14
        synthetic_request("b", [0, 0], category="y"),  # 0/14
        synthetic_request("c", [], category="y"),  # no drafts
    ]
    candidate = [
        synthetic_request("a", [7, 0], category="x"),  # 7/14
        synthetic_request("b", [7, 0], category="y"),  # 7/14
        synthetic_request("c", [], category="y"),
    ]
    cats = {r["category"]: r for r in per_category(control, candidate)}
    assert cats["x"]["n"] == 1 and cats["x"]["delta"] == pytest.approx(-0.5)
    assert cats["y"]["n"] == 2 and cats["y"]["control_rate"] == 0.0 and cats["y"]["candidate_rate"] == 0.5
    rows = per_request_deltas(control, candidate)
    assert [r["delta"] for r in rows] == [pytest.approx(-0.5), pytest.approx(0.5), None]


def test_compare_outputs_classifies_divergence():
    base = synthetic_request("a", [1], output_token_ids=[5, 6, 7, 8])
    assert compare_outputs([base], [base]) == []
    near = synthetic_request("a", [1], output_token_ids=[5, 6, 9, 8], top2_margins=[3.0, 3.0, 0.01, 3.0])
    (d,) = compare_outputs([base], [near], near_tie_margin=0.1)
    assert (d["first_divergence"], d["top2_margin"], d["classification"]) == (2, 0.01, "benign_near_tie")
    assert (d["control_token"], d["candidate_token"]) == (7, 9)
    sure = synthetic_request("a", [1], output_token_ids=[5, 6, 9, 8], top2_margins=[3.0, 3.0, 2.5, 3.0])
    assert compare_outputs([base], [sure])[0]["classification"] == "disagreement"
    blind = synthetic_request("a", [1], output_token_ids=[5, 6, 9, 8])  # no margins: cannot call it benign
    assert compare_outputs([base], [blind])[0]["classification"] == "disagreement"
    short = synthetic_request("a", [1], output_token_ids=[5, 6])
    assert compare_outputs([base], [short])[0]["first_divergence"] == 2
    assert common_prefix_length([1, 2, 3], [1, 2, 3]) == 3


def test_proposal_divergence_hand_example():
    # prompt_len 5: the first draft step happens with 6 committed tokens.
    control = synthetic_request("a", [2, 2], proposals=[[1, 2, 3], [4, 5, 6]], k=3)
    candidate = synthetic_request("a", [2, 2], proposals=[[1, 2, 9], [4, 5, 6]], k=3)
    assert [s[0] for s in control.draft_steps] == [6, 9]
    pd_ = proposal_divergence([control], [candidate])
    assert pd_["matched_steps"] == 2 and pd_["differing_steps"] == 1
    assert pd_["overall"] == 0.5
    assert pd_["per_position"] == [0.0, 0.0, 0.5]


def test_proposal_divergence_only_at_identical_context():
    # Different accepted lengths: steps at committed 6 match; later keys differ and are not compared.
    control = synthetic_request("a", [0, 3], proposals=[[1, 1], [2, 2]], k=3)
    candidate = synthetic_request("a", [3, 0], proposals=[[1, 1], [7, 7]], k=3)
    assert proposal_divergence([control], [candidate])["matched_steps"] == 1
    # Once target outputs diverge, equal committed counts no longer mean equal context.
    out_c = list(range(20))
    out_k = [0, 99] + list(range(2, 20))
    c = synthetic_request("a", [2, 2], proposals=[[1, 2, 3], [4, 5, 6]], k=3, output_token_ids=out_c)
    k = synthetic_request("a", [2, 2], proposals=[[1, 2, 3], [0, 0, 0]], k=3, output_token_ids=out_k)
    res = proposal_divergence([c], [k])
    assert res["matched_steps"] == 1 and res["overall"] == 0.0
    assert proposal_divergence([], [])["overall"] is None


# ---------------------------------------------------------------- against a baseline


def test_pair_by_id_orders_the_reference_like_tonight_and_allows_a_superset():
    reference, _ = synthetic_pair(8, 0.7, 0.7)
    tonight = list(reversed(reference[2:6]))
    base, now, retokenized = pair_by_id(reference, tonight)
    assert [r.id for r in base] == [r.id for r in now] == [r.id for r in tonight] and retokenized == []
    changed = replace(tonight[0], prompt_token_ids=[9, 9, 9])
    assert pair_by_id(reference, [changed, *tonight[1:]])[2] == [changed.id]  # counted, not refused
    with pytest.raises(QualError, match=r"1 of 2 requests are not in the baseline \(first: \['new'\]\)"):
        pair_by_id(reference, [tonight[0], replace(tonight[1], id="new")])
    with pytest.raises(QualError, match="duplicate request id"):
        pair_by_id(reference + reference[:1], tonight)


def _positions(control, candidate, **kw):
    return paired_bootstrap(control, candidate, **kw).per_position


def test_per_position_intervals_invariants():
    control, candidate = synthetic_pair(80, 0.7, 0.6, seed=5)
    rows = _positions(control, candidate, n_resamples=400, seed=1)
    a, b = acceptance_summary(control), acceptance_summary(candidate)
    assert [r["position"] for r in rows] == list(range(7))
    for r, pc, pk, cc, kc in zip(rows, a.per_position, b.per_position, a.per_position_conditional,
                                 b.per_position_conditional):
        assert r["control"] == pytest.approx(pc) and r["candidate"] == pytest.approx(pk)
        assert r["control_conditional"] == pytest.approx(cc) and r["candidate_conditional"] == pytest.approx(kc)
        assert r["delta"] == pytest.approx(pk - pc) and r["ci"][0] <= r["delta"] <= r["ci"][1]
        assert r["delta_conditional"] == pytest.approx(kc - cc)
        assert r["conditional_ci"][0] <= r["delta_conditional"] <= r["conditional_ci"][1]
        for arm in ("control", "candidate", "control_conditional", "candidate_conditional"):
            ci = r[f"{arm}_ci"]
            assert 0 <= ci[0] <= r[arm] <= ci[1] <= 1
        assert r["ci"][1] < 0  # per-token 0.7 -> 0.6 lowers every position, clearly at 80 requests
    assert rows[0]["control_conditional_ci"] == rows[0]["control_ci"]  # position 0: conditional is unconditional
    same = _positions(control, control, n_resamples=50)
    assert all(r["delta"] == 0 and r["ci"] == [0, 0] and r["conditional_ci"] == [0, 0] for r in same)
    # the interval comes from resampling requests: reversing the pairing's order changes nothing
    again = _positions(control[::-1], candidate[::-1], n_resamples=400, seed=1)
    assert [r["delta"] for r in again] == pytest.approx([r["delta"] for r in rows])
    assert _positions([], []) == []
    none = _positions([synthetic_request("a", [])], [synthetic_request("a", [])])
    assert all(r["control"] is None and r["ci"] is None and r["control_ci"] is None for r in none)
    with pytest.raises(QualError, match="equal arms"):
        paired_bootstrap(control, candidate[:3])


def test_per_position_intervals_come_from_the_headline_resamples():
    """With one draft position, position 0's rate is the pooled rate: its interval must be the headline's, exactly,
    which holds only if both come from the same resamples."""
    control, candidate = synthetic_pair(60, 0.6, 0.5, seed=9, k=1)
    boot = paired_bootstrap(control, candidate, n_resamples=500, seed=4)
    (row,) = boot.per_position
    assert row["delta"] == pytest.approx(boot.delta_rate)
    assert tuple(row["ci"]) == pytest.approx(boot.delta_rate_ci[0.95], abs=1e-15)


# -- decode speedup (`qual run --speedup`) ---------------------------------------------------------------------------


def _decoded(rid: str, tokens: int, seconds: float, steps: int):
    """A request of `tokens` output tokens whose decode (first token to last) took `seconds` over `steps` steps."""
    r = synthetic_request(rid, [])
    r = replace(r, output_token_ids=list(range(tokens)), drafts=0, draft_tokens=0, accepted_tokens=0,
                accepted_per_position=[], draft_steps=[])
    times = [0.1 + seconds * i / max(steps, 1) for i in range(steps + 1)]
    return replace(r, latency=measured_latency(0.0, times, times[-1], tokens))


def test_decode_speedup_is_a_ratio_of_sums_with_a_paired_interval():
    spec = [_decoded(f"r{i}", 1 + 10 * (i + 1), 0.5 * (i + 1), 4) for i in range(6)]
    plain = [_decoded(f"r{i}", 1 + 10 * (i + 1), 1.5 * (i + 1), 10 * (i + 1)) for i in range(6)]
    out = decode_speedup(spec, plain, n_resamples=500, seed=3)
    assert out.n_requests == 6
    assert out.speculative_rate == pytest.approx(210 / 10.5) and out.plain_rate == pytest.approx(210 / 31.5)
    assert out.ratio == pytest.approx(3.0)
    lo, hi = out.ratio_ci[0.95]
    assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)  # every request 3x: every resample says so


def test_decode_speedup_interval_spans_the_requests_own_ratios():
    factors = [1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 2.2, 2.8]
    spec = [_decoded(f"r{i}", 41, 1.0, 10) for i in range(8)]
    plain = [_decoded(f"r{i}", 41, f, 40) for i, f in enumerate(factors)]
    out = decode_speedup(spec, plain, n_resamples=2000, seed=0)
    assert out.ratio == pytest.approx(sum(factors) / 8)  # equal tokens and spec seconds: the mean factor
    lo, hi = out.ratio_ci[0.95]
    assert min(factors) < lo < out.ratio < hi < max(factors)
    assert decode_speedup(spec, plain, n_resamples=2000, seed=0) == out  # the seed fixes the resamples


def test_decode_speedup_leaves_out_what_either_arm_did_not_time():
    spec = [_decoded("a", 11, 1.0, 5), _decoded("b", 11, 1.0, 5), replace(_decoded("c", 11, 1.0, 5), latency=None)]
    plain = [_decoded("a", 11, 2.0, 10), _decoded("b", 1, 0.0, 0), _decoded("c", 11, 2.0, 10)]
    out = decode_speedup(spec, plain, n_resamples=100)
    assert out.n_requests == 1 and out.ratio == pytest.approx(2.0)  # b: one token, c: untimed
    none = decode_speedup(spec[2:], plain[2:], n_resamples=100)
    assert none.n_requests == 0 and none.ratio is None and none.ratio_ci == {0.95: None}
    with pytest.raises(QualError, match="equal arms"):
        decode_speedup(spec, plain[:2])


# ---------------------------------------------------------------- conversations of several turns


def _turns(arm_offset: int = 0, differ: bool = False):
    """Two conversations of two turns: (c1 turn 1, c1 turn 2, c2 turn 1, c2 turn 2). differ: the candidate's first
    answer of c1 differs, so its second turn's prompt does too."""
    rows = []
    for conv, lengths in (("c1", ([3, 1], [2, 2])), ("c2", ([0, 0, 1], [4]))):
        for turn, acc in enumerate(lengths, 1):
            r = synthetic_request(f"{conv}/turn{turn}", acc, category="chat")
            rows.append(replace(r, turn=turn, conversation=conv))
    if differ:
        first, second = rows[0], rows[1]
        rows[0] = replace(first, output_token_ids=[7] + first.output_token_ids[1:], top2_margins=None)
        rows[1] = replace(second, prompt_token_ids=second.prompt_token_ids + [9],
                          output_token_ids=[8] + second.output_token_ids[1:])
    return rows


def test_acceptance_per_turn_and_later_turns_whose_history_differs():
    control, candidate = _turns(), _turns(differ=True)
    c, k = pair_requests(control, candidate)  # a later turn's prompts may differ; a first turn's may not
    rows = per_turn(c, k)
    assert [(t["turn"], t["n"], t["earlier_turns_differ"]) for t in rows] == [(1, 2, 0), (2, 2, 1)]
    assert rows[0]["control_rate"] == pytest.approx((3 + 1 + 0 + 0 + 1) / (5 * 7))
    assert rows[1]["control_rate"] == pytest.approx((2 + 2 + 4) / (3 * 7))
    deltas = per_request_deltas(c, k)
    assert [(d["turn"], d["earlier_turns_differ"]) for d in deltas] == [(1, False), (2, True), (1, False), (2, False)]
    # the first turn's flip is a divergence; the second turn, built on it, is not compared again
    assert [d["id"] for d in compare_outputs(c, k)] == ["c1/turn1"]
    # c1's turn 1 diverges at its first output token (no step after it matches), its turn 2 is skipped: c2's 3 + 1
    assert proposal_divergence(c, k)["matched_steps"] == 4
    with pytest.raises(QualError, match="prompt token ids differ"):
        pair_requests(control, [replace(candidate[0], prompt_token_ids=[1])] + candidate[1:])
    assert per_turn(*[[replace(r, turn=1, conversation=None) for r in rows] for rows in (c, k)]) == []


def test_the_bootstrap_resamples_conversations():
    control, candidate = _turns(), _turns()
    boot = paired_bootstrap(control, candidate, n_resamples=200, seed=3)
    assert boot.n_requests == 2  # two conversations of two turns each
    one = paired_bootstrap([replace(r, conversation=None) for r in control],
                           [replace(r, conversation=None) for r in candidate], n_resamples=200, seed=3)
    assert one.n_requests == 4 and one.delta_rate == boot.delta_rate == 0.0
