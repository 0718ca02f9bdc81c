"""The consistency every engine's latency records keep (docs/statistics.md, "Latency"): shared by the embedded
runtime's and vLLM's tests."""

TOLERANCE = 0.05  # a request's end within 5% of its end-to-end latency after its last token, or END_SLACK_S
# A stream ends after its last token (vLLM's usage event, then [DONE]): on the 2-core CI host under two test workers
# that came 4.2 ms after the last token of an 82 ms request, more than 5% of it
END_SLACK_S = 0.010


def assert_latency_consistent(r, streamed: bool = True) -> None:
    """TTFT <= end-to-end for every request; TPOT x (tokens - 1) + TTFT is the last step's time (to the rounding of
    microseconds), which ends the request, within TOLERANCE of end-to-end (or END_SLACK_S); the steps in order, at
    most one a token, their decode time within the first-to-last span. streamed: each step's tokens were timed (else
    only the end)."""
    lat, n = r.latency, len(r.output_token_ids)
    assert lat is not None, r.id
    assert lat["e2e_s"] > 0, r.id
    if not streamed:
        assert lat["ttft_s"] is None and lat["tpot_s"] is None and lat["step_times_s"] == []
        return
    steps = lat["step_times_s"]
    assert lat["ttft_s"] == steps[0] and 0 < lat["ttft_s"] <= lat["e2e_s"], r.id
    assert steps == sorted(steps) and 1 <= len(steps) <= n and steps[-1] <= lat["e2e_s"], r.id
    if n > 1:
        rebuilt = lat["tpot_s"] * (n - 1) + lat["ttft_s"]
        assert abs(rebuilt - steps[-1]) <= 1e-6 * (n + 1), (r.id, rebuilt, steps[-1])
        assert lat["e2e_s"] - steps[-1] <= max(TOLERANCE * lat["e2e_s"], END_SLACK_S), (r.id, steps[-1], lat["e2e_s"])
    if len(steps) > 1:
        assert 0 <= lat["decode_steps_s"] <= steps[-1] - steps[0] + 1e-6, r.id
