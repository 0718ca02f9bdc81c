"""The latency and speedup views the renderers share: per-arm percentiles, the `--speedup` statement, and whether the
timings came from a CPU (no I/O, no markup)."""

from __future__ import annotations

from dataclasses import dataclass

from qual.result import ArmResult, Result

METRICS = (("ttft_s", "time to first token"), ("tpot_s", "time per output token"), ("e2e_s", "end-to-end latency"),
           ("queued_s", "queued before admission"))
CPU_SHORT = "measured on a CPU: noisy"
CPU_NOTE = ("measured on a CPU: timings there are noisy (other processes share the cores and can move a step's cost "
            "several times over), so read latency and speedup as rough; on a GPU they are the numbers to quote")


def seconds(x: float | None) -> str:
    """0.01234 -> '12.3 ms'; 2.5 -> '2.50 s'."""
    if x is None:
        return "n/a"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def times(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"\u00d7{x:.{digits}f}"


def arms(result: Result) -> dict[str, ArmResult]:
    """The arms with latency to show: control, candidate, and plain decoding where the run had --speedup."""
    out = dict(result.arms)
    if result.speedup is not None:
        out["plain"] = result.speedup.plain
    return out


@dataclass(frozen=True)
class LatencyRow:
    label: str
    cells: dict[str, str]  # arm -> "p50 / p90 / p99" or the one number


def latency_rows(result: Result) -> list[LatencyRow]:
    """p50 / p90 / p99 of each latency per arm, each arm's decode tokens/s and decode step; none where no arm was
    timed (a result written before qual timed requests)."""
    shown = arms(result)
    if not any(a.latency for a in shown.values()):
        return []

    def pcts(a: ArmResult, key: str) -> str:
        p = (a.latency or {}).get(key) or {}
        return "n/a" if not p.get("n") else " / ".join(seconds(p[q]) for q in ("p50", "p90", "p99"))

    rows = [LatencyRow(f"{label} (p50 / p90 / p99)", {arm: pcts(a, key) for arm, a in shown.items()})
            for key, label in METRICS
            if key != "queued_s" or any(((a.latency or {}).get(key) or {}).get("n") for a in shown.values())]

    def rate(a: ArmResult) -> str:
        x = (a.latency or {}).get("decode_tokens_per_second")
        return "n/a" if x is None else f"{x:.1f} tok/s"

    def step(a: ArmResult) -> str:
        lat = a.latency or {}
        if lat.get("step_s") is None:
            return "n/a"
        return f"{seconds(lat['step_s'])} ({lat['decode_steps']} request steps)"

    rows.append(LatencyRow("decode tokens/s per request", {arm: rate(a) for arm, a in shown.items()}))
    rows.append(LatencyRow("decode step, as a request sees it", {arm: step(a) for arm, a in shown.items()}))
    return rows


def on_cpu(result: Result) -> bool:
    """Whether an arm's timings came from a CPU: its engine's host reports no GPU, or an engine qual ran was asked for
    the CPU (an attached server's device is its own)."""
    for a in arms(result).values():
        host = a.provenance.engine.host if a.provenance is not None else None
        if (host is not None and not host.gpus) or (a.config.get("engine") != "attach" and a.config.get("device") == "cpu"):
            return True
    return False


def speedup_lines(result: Result) -> list[str]:
    """The `--speedup` statement, sentences a report opens with: the per-request decode rate ratio with its interval
    (the one the acceptance-implied bound applies to), the batch's throughput ratio, and where the two disagree in
    direction, that and why it can be; [] without --speedup."""
    s = result.speedup
    if s is None:
        return []
    if s.ratio is None:
        return ["speedup: n/a (the candidate or plain decoding did not run, or no request was timed)"]
    rates, batch = s.decode_tokens_per_second, s.generate_tokens_per_second
    ci = f"95% CI {times(s.ratio_ci95[0])}\u2013{times(s.ratio_ci95[1])}" if s.ratio_ci95 else "no interval"
    bound = (f"the acceptance-implied bound {times(s.bound)} (mean acceptance length {s.mean_acceptance_length:.3f} "
             f"\u00d7 plain step {seconds(s.step_s['plain'])} / speculative step {seconds(s.step_s['speculative'])}) "
             "applies to this ratio" if s.bound is not None else "no acceptance-implied bound (a step cost is missing)")
    lines = [f"speedup per request {times(s.ratio)} ({ci}, {s.n_requests} requests): decode {rates['speculative']:.1f} "
             f"tok/s speculative vs {rates['plain']:.1f} plain, each request's tokens over its own decode time; {bound}"]
    if s.batch_ratio is not None:
        lines.append(f"batch throughput {times(s.batch_ratio)}: {batch['speculative']:.1f} tok/s speculative vs "
                     f"{batch['plain']:.1f} plain, all output tokens over each arm's generation time (one number an "
                     "arm, no interval)")
    if s.directions_agree is False:
        faster, slower = ("each request decodes faster", "the batch runs slower") if s.ratio >= 1 else \
            ("the batch runs faster", "each request decodes slower")
        lines.append(f"the two disagree: {faster} with speculation, {slower}; the batch's time also holds what runs "
                     "between a request's steps (other requests' admissions and prefills, the engine's own work), which "
                     "the per-request rate leaves out")
    return lines
