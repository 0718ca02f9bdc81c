"""Spec-decode counters from vLLM's Prometheus /metrics text (docs/vllm.md)."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from qual.records import AcceptanceCounts

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text exposition, (name, labels, value), read by prometheus_client's parser. A
    server's /metrics is untrusted: the transport caps the reply's size before it gets here (REPLY_CAPS in
    qual.engines.vllm.client), and text the parser cannot read is a ValueError whatever the parser raised."""
    try:
        return [(s.name, dict(s.labels), float(s.value)) for family in text_string_to_metric_families(text)
                for s in family.samples]
    except (ValueError, TypeError, IndexError, KeyError) as exc:  # hostile text reaches the parser's indexing too
        raise ValueError(f"malformed Prometheus text ({type(exc).__name__}: {exc})") from None


def _as_int(value: float, name: str) -> int:
    if not math.isfinite(value) or value != int(value):  # int(inf) would be an OverflowError, not a refusal
        raise ValueError(f"{name} is not an integer count: {value}")
    return int(value)


def parse_spec_counters(text: str) -> AcceptanceCounts:
    """The server's cumulative spec-decode counters: the `_total` series summed across engine/model labels (never
    the `_created` ones); zeros where it exposes none."""
    totals = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    per_pos: dict[int, float] = {}
    for name, labels, value in parse_samples(text):
        if name in totals:
            totals[name] += value
        elif name == ACCEPTED_PER_POS:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    k = max(per_pos) + 1 if per_pos else 0
    return AcceptanceCounts(
        drafts=_as_int(totals[DRAFTS], DRAFTS),
        draft_tokens=_as_int(totals[DRAFT_TOKENS], DRAFT_TOKENS),
        accepted_tokens=_as_int(totals[ACCEPTED], ACCEPTED),
        accepted_per_position=[_as_int(per_pos.get(i, 0.0), ACCEPTED_PER_POS) for i in range(k)],
    )


def counts_from_reply(metrics: dict, k: int) -> AcceptanceCounts:
    """One request's counts from its reply's metrics.speculative_decoding (vLLM's per-request metrics)."""
    hist = list(metrics["acceptance_histogram"])  # hist[j]: verify steps that accepted exactly j drafts
    # Position i is accepted in every step that accepted more than i drafts (greedy prefix rule).
    per_pos = [sum(hist[i + 1 :]) for i in range(k)]
    return AcceptanceCounts(int(metrics["num_spec_steps"]), int(metrics["num_draft_tokens"]),
                            int(metrics["num_accepted_draft_tokens"]), per_pos)
