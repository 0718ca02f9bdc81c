"""Spec-decode counters from vLLM's Prometheus /metrics text (docs/vllm.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative spec-decode counters of one server, summed over its engines."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = field(default_factory=tuple)
    present: bool = False  # the server exposed the spec-decode series at all

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        k = max(len(self.accepted_per_position), len(before.accepted_per_position))
        now = _padded(self.accepted_per_position, k)
        old = _padded(before.accepted_per_position, k)
        return SpecCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted_tokens=self.accepted_tokens - before.accepted_tokens,
            accepted_per_position=tuple(a - b for a, b in zip(now, old)),
            present=self.present,
        )

    def per_position(self, k: int) -> list[int]:
        """Accepted counts at draft positions 0..k-1 (zeros where the server has no series)."""
        return list(_padded(self.accepted_per_position, k))


def _padded(values: tuple[int, ...], k: int) -> tuple[int, ...]:
    return tuple(values[:k]) + (0,) * max(0, k - len(values))


def _as_int(value: float, name: str) -> int:
    if value != int(value):
        raise ValueError(f"{name} is not an integer count: {value}")
    return int(value)


def parse_spec_counters(text: str) -> SpecCounters:
    """Sum the `_total` spec-decode series across engine/model labels (never the `_created` ones)."""
    totals = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    per_pos: dict[int, float] = {}
    present = False
    for name, labels, value in parse_samples(text):
        if name in totals:
            totals[name] += value
            present = True
        elif name == ACCEPTED_PER_POS:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
            present = True
    k = max(per_pos) + 1 if per_pos else 0
    return SpecCounters(
        drafts=_as_int(totals[DRAFTS], DRAFTS),
        draft_tokens=_as_int(totals[DRAFT_TOKENS], DRAFT_TOKENS),
        accepted_tokens=_as_int(totals[ACCEPTED], ACCEPTED),
        accepted_per_position=tuple(_as_int(per_pos.get(i, 0.0), ACCEPTED_PER_POS) for i in range(k)),
        present=present,
    )
