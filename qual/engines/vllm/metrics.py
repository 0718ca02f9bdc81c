"""Spec-decode counters from vLLM's Prometheus /metrics text (docs/vllm.md)."""

from __future__ import annotations

import re

from qual.records import AcceptanceCounts

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _unescape(value: str) -> str:
    return value.replace(r"\\", "\x00").replace(r"\"", '"').replace(r"\n", "\n").replace("\x00", "\\")


def _labels(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    out: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            raise ValueError(f"malformed Prometheus labels: {{{text}}}")
        out[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return out


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample line of a Prometheus text exposition: (name, labels, value)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError(f"malformed Prometheus sample: {line!r}")
        samples.append((m.group("name"), _labels(m.group("labels")), float(m.group("value"))))
    return samples


def _as_int(value: float, name: str) -> int:
    if value != int(value):
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
