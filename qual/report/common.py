"""Number formatting and derived views shared by the renderers (no I/O, no markup)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qual.intervals import small_sample_note
from qual.outcomes import INCONCLUSIVE
from qual.result import Result, Throughput


def pct(x: float | None, digits: int = 2) -> str:
    """0.3531 -> '35.31%'."""
    return "n/a" if x is None else f"{x * 100:.{digits}f}%"


def pp(x: float | None, digits: int = 2) -> str:
    """A rate delta in percentage points, signed: -0.0866 -> '-8.66 pp'."""
    return "n/a" if x is None else f"{x * 100:+.{digits}f} pp"


def num(x: float | None, digits: int = 3, signed: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def ci_pp(ci: list[float] | tuple[float, float] | None, unit: bool = True) -> str:
    """A rate-delta interval in pp: '[-9.10, -8.20] pp' ('[-9.10, -8.20]' without the unit)."""
    return "n/a" if ci is None else f"[{ci[0] * 100:+.2f}, {ci[1] * 100:+.2f}]" + (" pp" if unit else "")


def gib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def throughput(t: Throughput) -> str:
    """Generation tok/s where the engine timed it apart from its start-up (the first arm of a process pays one-time
    CUDA costs there), then tok/s over the arm's whole wall time."""
    whole = f"{t.tokens_per_second:.1f} tok/s"
    gen = t.generate_tokens_per_second
    return whole if gen is None else f"{gen:.1f} tok/s generating ({whole} with start-up)"


def inconclusive_note(gate) -> str | None:
    """What an INCONCLUSIVE gate exits with and why (None for another outcome): one line, for every renderer."""
    if gate.outcome != INCONCLUSIVE:
        return None
    needed = max((c.needed_requests for c in gate.checks if c.inconclusive and c.needed_requests), default=None)
    more = f"; about {needed} requests would resolve it at this variance" if needed else ""
    exits = "exits 0 (the gate's inconclusive: pass)" if gate.passed else "exits 1 (the gate's inconclusive: fail)"
    return (f"INCONCLUSIVE: no check failed, but an interval straddles its threshold{more}; it {exits} and is never "
            "a series' last pass")


def replayed(result: Result) -> str:
    """How many requests the run replayed: '8 requests', or '16 requests (8 conversations)' over several turns."""
    n = max(len(result.control.per_request), len(result.candidate.per_request))
    rows = result.corpus.count
    return f"{rows} requests" if n in (0, rows) else f"{n} requests ({rows} conversations)"


def interval_note(result: Result) -> str | None:
    """The caveat shown beside the verdict where the comparison's intervals rest on fewer resampling units than
    their coverage needs (qual.intervals.MIN_UNITS); None otherwise."""
    boot = result.comparison.bootstrap
    return small_sample_note(boot.get("n_requests"), boot.get("unit", "request"))


def title(result: Result) -> str:
    """'toy: DCP 1 -> DCP 4 (reference, draft KV sharded)'; arms of two models (qual compare):
    'toy DCP 1 -> glm-toy DCP 4 (...)'."""
    c, k = result.control.config, result.candidate.config
    cm, km = c.get("model", "?"), k.get("model", "?")
    arms = (f"{km}: DCP {c.get('dcp', '?')} \u2192 DCP {k.get('dcp', '?')}" if cm == km
            else f"{cm} DCP {c.get('dcp', '?')} \u2192 {km} DCP {k.get('dcp', '?')}")
    return (
        f"{arms} "
        f"({k.get('engine', '?')}, TP {k.get('tp', '?')}, draft KV {k.get('draft_kv', '?')}"
        + (f", DSA top-k {k['dsa_topk']}" if k.get("dsa_topk") else "")
        + (f", numerics {k['numerics']}" if k.get("numerics") else "") + ")"
    )


@dataclass(frozen=True)
class HeadlineRow:
    label: str
    control: str
    candidate: str
    delta: str


def headline(result: Result) -> list[HeadlineRow]:
    """The numbers a reviewer reads first, formatted."""
    a, b, cmp = result.control.acceptance, result.candidate.acceptance, result.comparison
    n = len(result.control.per_request)
    prop = cmp.proposal_divergence or {}
    if cmp.target_outputs_identical is None:
        identical = "n/a"
    elif cmp.target_outputs_identical:
        identical = f"yes ({n}/{n})"
    else:
        kinds = [d["classification"] for d in cmp.output_divergence]
        identical = (
            f"no: {len(kinds)}/{n} differ ({kinds.count('benign_near_tie')} near-tie, "
            f"{kinds.count('disagreement')} disagreement)"
        )
        if cmp.earlier_turns_differ:
            identical += f"; {len(cmp.earlier_turns_differ)} later turns not compared (earlier turns differ)"
    if prop.get("matched_steps"):
        proposals = f"{pct(prop.get('overall'), 1)} of {prop['matched_steps']} matched draft steps differ"
    else:
        proposals = "n/a (no matched draft steps)"
    rate_delta = pp(cmp.delta_rate)
    if cmp.delta_rate_ci95 is not None:
        rate_delta += f" (95% CI {ci_pp(cmp.delta_rate_ci95)})"
    return [
        HeadlineRow("acceptance rate", pct(a.rate), pct(b.rate), rate_delta),
        HeadlineRow(
            "mean acceptance length",
            num(a.mean_acceptance_length),
            num(b.mean_acceptance_length),
            num(cmp.delta_mean_acceptance_length, signed=True),
        ),
        HeadlineRow("drafts", str(a.drafts), str(b.drafts), f"{b.drafts - a.drafts:+d}"),
        HeadlineRow("draft tokens", str(a.draft_tokens), str(b.draft_tokens), f"{b.draft_tokens - a.draft_tokens:+d}"),
        HeadlineRow(
            "accepted tokens", str(a.accepted_tokens), str(b.accepted_tokens), f"{b.accepted_tokens - a.accepted_tokens:+d}"
        ),
        HeadlineRow("target outputs identical", "", "", identical),
        HeadlineRow("draft proposals at identical context", "", "", proposals),
        HeadlineRow("throughput", throughput(result.control.throughput), throughput(result.candidate.throughput),
                    throughput_delta(result)),
    ]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


@dataclass(frozen=True)
class ConfigRow:
    key: str
    control: str
    candidate: str
    differs: bool


def config_diff(result: Result) -> list[ConfigRow]:
    """Every (flattened) config key of both arms; differing keys first, then alphabetical."""
    c, k = _flatten(result.control.config), _flatten(result.candidate.config)
    missing = object()
    rows = []
    for key in sorted(set(c) | set(k)):
        vc, vk = c.get(key, missing), k.get(key, missing)
        rows.append(
            ConfigRow(
                key,
                "(absent)" if vc is missing else _show(vc),
                "(absent)" if vk is missing else _show(vk),
                vc != vk,
            )
        )
    return sorted(rows, key=lambda r: (not r.differs, r.key))


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict) and not v:
        return "{}"
    return str(v)


def graph_rows(result: Result) -> list[tuple[str, str, str, bool]]:
    """(field, control, candidate, differs) for the graph-capture comparison."""
    gc, gk = result.control.graph_capture, result.candidate.graph_capture

    def sizes(g: dict, key: str) -> str:
        return ", ".join(str(s) for s in sorted(g.get(key) or [])) or "none"

    def secs(g: dict) -> str:
        return "n/a" if g.get("seconds") is None else f"{g['seconds']:.1f} s"

    rows = [
        ("status", str(gc.get("status")), str(gk.get("status"))),
        ("mode", str(gc.get("mode") or "n/a"), str(gk.get("mode") or "n/a")),
        ("sizes", sizes(gc, "sizes"), sizes(gk, "sizes")),
        ("eager fallback sizes", sizes(gc, "eager_fallback_sizes"), sizes(gk, "eager_fallback_sizes")),
        ("capture time", secs(gc), secs(gk)),
        ("memory", gib(gc.get("bytes")), gib(gk.get("bytes"))),
        ("detail", str(gc.get("detail") or ""), str(gk.get("detail") or "")),
    ]
    # Time and memory always differ a little; only flag what the gate cares about.
    flagged = {"status", "mode", "sizes", "eager fallback sizes"}
    return [(f, a, b, f in flagged and a != b) for f, a, b in rows]


def worst_requests(result: Result, n: int = 10) -> list[dict]:
    """Up to n requests whose candidate rate fell most below control (only those that fell)."""
    rows = [r for r in result.comparison.per_request_deltas if r.get("delta") is not None and r["delta"] < 0]
    return sorted(rows, key=lambda r: (r["delta"], r["id"]))[:n]


def delta_counts(result: Result) -> dict[str, int]:
    """How many paired requests got worse / stayed / got better."""
    ds = [r["delta"] for r in result.comparison.per_request_deltas if r.get("delta") is not None]
    return {
        "worse": sum(d < 0 for d in ds),
        "same": sum(d == 0 for d in ds),
        "better": sum(d > 0 for d in ds),
        "undefined": len(result.comparison.per_request_deltas) - len(ds),
    }


def throughput_delta(result: Result) -> str:
    """Candidate vs control speed: generation tok/s where both arms timed generation apart from start-up, else tok/s
    over the whole arm."""
    a, b = result.control.throughput, result.candidate.throughput
    ga, gb = a.generate_tokens_per_second, b.generate_tokens_per_second
    x, y, what = (ga, gb, "generating") if ga and gb else (a.tokens_per_second, b.tokens_per_second, "whole arm")
    if not x or not y or not (result.control.runnable and result.candidate.runnable):
        return "n/a"
    return f"{(y / x - 1) * 100:+.1f}% (\u00d7{y / x:.2f}, {what})"
