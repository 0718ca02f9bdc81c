"""result.json for notebooks: `qual.load(path)` reads a run (single or sweep) and gives its tables as pandas DataFrames.

One row per thing measured, the arm (or the candidate compared) in a column, so a table groups, pivots and plots as
it is; rates are fractions, an undefined one NaN (result.json's null). pandas is imported when a table is first
built: `import qual` and the command line never load it.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from qual.result import ArmResult, Comparison, Result
from qual.sweep_result import SweepResult, load_any

LATENCIES = ("ttft_s", "tpot_s", "e2e_s", "queued_s")  # a request's latency record's times (qual.records)


def _frame(rows: list[dict], columns: list[str]):
    import pandas as pd

    return pd.DataFrame(rows, columns=columns)


class Run:
    """One result.json: `result` (a qual.result.Result, or a SweepResult), its arms by name, and its tables."""

    def __init__(self, path: Path, result: Result | SweepResult):
        self.path, self.result = path, result

    @property
    def is_sweep(self) -> bool:
        return isinstance(self.result, SweepResult)

    @property
    def arms(self) -> dict[str, ArmResult]:
        """control, then the candidate (a sweep's candidates by name), then plain decoding where the run had
        --speedup."""
        r = self.result
        if isinstance(r, SweepResult):
            return {"control": r.control, **{c.name: c.candidate for c in r.comparisons}}
        return {**r.arms, **({"plain": r.speedup.plain} if r.speedup is not None else {})}

    @property
    def comparisons(self) -> dict[str, Comparison]:
        """Each candidate's comparison with the control, by the candidate's name."""
        r = self.result
        return {c.name: c.comparison for c in r.comparisons} if isinstance(r, SweepResult) else {"candidate": r.comparison}

    @cached_property
    def summary(self):
        """One row an arm: its layout, acceptance, output and times."""
        rows = []
        for arm, a in self.arms.items():
            acc, lat = a.acceptance, a.latency or {}
            rows.append({"arm": arm, **{k: a.config.get(k) for k in ("engine", "dcp", "tp", "draft_kv", "dtype",
                                                                       "device")},
                         "runnable": a.runnable, "requests": len(a.per_request), "rate": acc.rate,
                         "mean_acceptance_length": acc.mean_acceptance_length, "drafts": acc.counts.drafts,
                         "draft_tokens": acc.counts.draft_tokens, "accepted_tokens": acc.counts.accepted_tokens,
                         "output_tokens": a.throughput.output_tokens, "wall_seconds": a.throughput.wall_seconds,
                         "generate_seconds": a.throughput.generate_seconds,
                         "decode_tokens_per_second": lat.get("decode_tokens_per_second"), "step_s": lat.get("step_s")})
        return _frame(rows, list(rows[0]))

    @cached_property
    def requests(self):
        """One row an arm's request: its counts, rates, tokens and latency (NaN where the engine did not time it)."""
        columns = ["arm", "id", "category", "turn", "conversation", "prompt_tokens", "output_tokens", "drafts",
                   "draft_tokens", "accepted_tokens", "rate", "mean_acceptance_length", "finish_reason",
                   "acceptance_source", *LATENCIES, "decode_steps_s"]
        rows = []
        for arm, a in self.arms.items():
            for q in a.per_request:
                lat: dict[str, Any] = q.latency or {}
                rows.append({"arm": arm, "id": q.id, "category": q.category, "turn": q.turn,
                             "conversation": q.conversation, "prompt_tokens": len(q.prompt_token_ids),
                             "output_tokens": len(q.output_token_ids), "drafts": q.drafts,
                             "draft_tokens": q.draft_tokens, "accepted_tokens": q.accepted_tokens,
                             "rate": q.counts.rate, "mean_acceptance_length": q.counts.mean_acceptance_length,
                             "finish_reason": q.finish_reason, "acceptance_source": q.acceptance_source,
                             **{k: lat.get(k) for k in (*LATENCIES, "decode_steps_s")}})
        return _frame(rows, columns)

    @cached_property
    def positions(self):
        """One row an arm's draft position: steps accepted there, the rate (accepted / drafts, vLLM's) and the
        conditional rate (accepted / accepted at the position before)."""
        rows = []
        for arm, a in self.arms.items():
            acc = a.acceptance.to_json()
            for i, accepted in enumerate(acc["accepted_per_position"]):
                rows.append({"arm": arm, "position": i, "accepted": accepted, "drafts": acc["drafts"],
                             "rate": acc["per_position"][i], "conditional_rate": acc["per_position_conditional"][i]})
        return _frame(rows, ["arm", "position", "accepted", "drafts", "rate", "conditional_rate"])

    @cached_property
    def categories(self):
        """One row a candidate's category: both arms' rates, the delta and the draft tokens behind them."""
        columns = ["candidate", "category", "n", "control_rate", "candidate_rate", "delta", "control_draft_tokens",
                   "candidate_draft_tokens"]
        rows = [{"candidate": name, **row} for name, c in self.comparisons.items() for row in c.per_category]
        return _frame(rows, columns)

    @cached_property
    def turns(self):
        """One row a candidate's turn of the conversations (none for requests of one turn)."""
        columns = ["candidate", "turn", "n", "control_rate", "candidate_rate", "delta", "control_draft_tokens",
                   "candidate_draft_tokens", "earlier_turns_differ"]
        rows = [{"candidate": name, **row} for name, c in self.comparisons.items() for row in c.per_turn]
        return _frame(rows, columns)

    @cached_property
    def latency(self):
        """One row an arm's latency (time to first token, per output token, end to end, queued): how many requests
        have it, their mean and p50 / p90 / p99, in seconds (an arm nobody timed has no rows)."""
        rows = [{"arm": arm, "metric": metric, **(a.latency[metric])} for arm, a in self.arms.items() if a.latency
                for metric in LATENCIES]
        return _frame(rows, ["arm", "metric", "n", "mean", "p50", "p90", "p99"])

    def __repr__(self) -> str:
        kind = f"sweep of {len(self.comparisons)} candidates" if self.is_sweep else "run"
        return f"<qual {kind} {self.path}: {', '.join(self.arms)}>"


def load(path: str | Path) -> Run:
    """A run directory or its result.json (a single run's or a sweep's), for analysis; QualError where it is not one."""
    path = Path(path)
    file = path / "result.json" if path.is_dir() else path
    return Run(file, load_any(file))
