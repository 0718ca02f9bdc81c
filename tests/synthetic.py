"""Synthetic RequestResults and arms for testing the pure statistics, gate and reports.

Accepted lengths are drawn like a greedy verifier would produce them: each
draft position is accepted with probability p only if the previous one was.
Both arms of a pair share the same uniforms (common random numbers), so a
change of p moves every request in the same direction, as a real regression does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from qual.records import ArmConfig, ArmRunInfo, GraphCapture, RequestResult, Sampling
from qual.gate import Gate, parse_rules
from qual.harness.build import build_result
from qual.result import CorpusInfo, Result

K = 7
SYNTHETIC_FINGERPRINT = "sha256:" + "ab" * 32
NIGHTLY_RULES = [
    {"check": "candidate_runnable"},
    {"check": "acceptance_delta_lower_bound", "min_pp": -0.5, "confidence": 0.95},
    {"check": "mean_acceptance_length_ratio", "min": 0.98},
    {"check": "target_outputs_identical", "when_temperature": 0, "allow": "benign_near_tie"},
    {"check": "graph_sizes_captured"},
]


def synthetic_request(
    id: str,
    accept_lengths: Sequence[int],
    *,
    k: int = K,
    category: str = "default",
    prompt_len: int = 5,
    proposals: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[int] | None = None,
    top2_margins: Sequence[float] | None = None,
) -> RequestResult:
    """A self-consistent RequestResult from the accepted length of each draft step."""
    per_pos = [sum(1 for a in accept_lengths if a > i) for i in range(k)]
    steps, committed = [], prompt_len + 1  # prefill commits the first output token
    for j, a in enumerate(accept_lengths):
        props = list(proposals[j]) if proposals is not None else [(j * 31 + i * 7) % 97 for i in range(k)]
        steps.append([committed, props])
        committed += a + 1  # accepted drafts plus the target's bonus token
    n_out = committed - prompt_len
    return RequestResult(
        id=id,
        category=category,
        prompt_token_ids=[(sum(map(ord, id)) + i) % 50 for i in range(prompt_len)],
        output_token_ids=list(output_token_ids) if output_token_ids is not None else [i % 89 for i in range(n_out)],
        drafts=len(accept_lengths),
        draft_tokens=k * len(accept_lengths),
        accepted_tokens=sum(accept_lengths),
        accepted_per_position=per_pos,
        finish_reason="length",
        draft_steps=steps,
        top2_margins=list(top2_margins) if top2_margins is not None else None,
    )


def _accept_lengths(u: np.ndarray, p: float) -> list[int]:
    # u: [drafts, K] uniforms; the accepted prefix ends at the first u >= p.
    ok = u < p
    return [int(np.argmin(row)) if not row.all() else len(row) for row in ok]


def synthetic_pair(
    n: int,
    p_control: float,
    p_candidate: float,
    *,
    seed: int = 0,
    drafts_per_request: int = 10,
    categories: Sequence[str] = ("code", "math", "chat"),
    k: int = K,
) -> tuple[list[RequestResult], list[RequestResult]]:
    """Paired per-request results of two arms with per-token acceptance probabilities p."""
    rng = np.random.default_rng(seed)
    control, candidate = [], []
    for i in range(n):
        u = rng.random((drafts_per_request, k))  # shared by both arms
        cat = categories[i % len(categories)]
        control.append(synthetic_request(f"r{i:03d}", _accept_lengths(u, p_control), k=k, category=cat))
        candidate.append(synthetic_request(f"r{i:03d}", _accept_lengths(u, p_candidate), k=k, category=cat))
    if p_control == p_candidate:
        return control, candidate
    # Different acceptance means different draft steps; only the outputs are kept equal (the target decides them).
    # Both arms stop at the shorter one's length (max_tokens cutting the last step short), which keeps every
    # record one an engine can produce: n output tokens from d steps accepting a drafts, d + 1 <= n <= 1 + d + a.
    same = []
    for c, k_ in zip(control, candidate):
        out = list(c.output_token_ids[: min(len(c.output_token_ids), len(k_.output_token_ids))])
        same.append((replace(c, output_token_ids=out), replace(k_, output_token_ids=out)))
    return [c for c, _ in same], [k_ for _, k_ in same]


def synthetic_arm_config(dcp: int, draft_kv: str = "replicated", temperature: float = 0.0, **kw) -> ArmConfig:
    """An ArmConfig for the toy model at the given DCP size."""
    return ArmConfig(
        engine=kw.pop("engine", "reference"),
        model=kw.pop("model", "toy"),
        dcp=dcp,
        tp=kw.pop("tp", 4),
        draft_kv=draft_kv,
        target_path=kw.pop("target_path", "models/toy/target"),
        draft_path=kw.pop("draft_path", "models/toy/draft"),
        num_speculative_tokens=kw.pop("num_speculative_tokens", K),
        sampling=kw.pop("sampling", Sampling(temperature=temperature, seed=0, max_tokens=64)),
        **kw,
    )


def synthetic_run_info(
    requests: Sequence[RequestResult], graph: GraphCapture | None = None, runnable: bool = True, reason: str | None = None
) -> ArmRunInfo:
    """ArmRunInfo with plausible throughput numbers."""
    out = sum(len(r.output_token_ids) for r in requests)
    return ArmRunInfo(
        engine_version="qual-reference 0.1.0",
        graph_capture=graph or GraphCapture(),
        wall_seconds=max(out / 500.0, 0.01),
        output_tokens=out,
        runnable=runnable,
        not_runnable_reason=reason,
    )


def synthetic_gate(rules: list[dict] | None = None) -> Gate:
    return parse_rules(rules or NIGHTLY_RULES, "synthetic.yaml")


def synthetic_result(
    n: int = 40,
    p_control: float = 0.75,
    p_candidate: float = 0.75,
    *,
    draft_kv: str = "replicated",
    seed: int = 0,
    n_resamples: int = 500,
    control_graph: GraphCapture | None = None,
    candidate_graph: GraphCapture | None = None,
    rules: list[dict] | None = None,
    categories: Sequence[str] = ("code", "math", "chat"),
    pair: tuple[list[RequestResult], list[RequestResult]] | None = None,
    created_at: str = "2026-12-01T02:00:00+00:00",
    fingerprint: str = SYNTHETIC_FINGERPRINT,
    corpus_name: str = "synthetic",
    dcp: int = 4,
    baseline=None,
    **arm: object,
) -> Result:
    """A full Result of a synthetic control (DCP1) vs candidate (DCP4) run.

    arm: ArmConfig fields of both arms (model, engine, tp, sampling, ...); baseline: a ResolvedBaseline to compare with.
    """
    control, candidate = pair or synthetic_pair(n, p_control, p_candidate, seed=seed, categories=categories,
                                                k=int(arm.get("num_speculative_tokens", K)))
    corpus = CorpusInfo(corpus_name, f"corpora/{corpus_name}.jsonl", fingerprint, len(control))
    return build_result(
        corpus,
        (synthetic_arm_config(1, draft_kv, **dict(arm)), synthetic_run_info(control, control_graph), control),
        (synthetic_arm_config(dcp, draft_kv, **dict(arm)), synthetic_run_info(candidate, candidate_graph), candidate),
        synthetic_gate(rules),
        seed,
        reproduce=f"qual run --dcp {dcp} --draft-kv {draft_kv} --seed {seed}",
        n_resamples=n_resamples,
        created_at=created_at,
        baseline=baseline,
    )


def truncated(rows: Sequence[RequestResult], keep: int, only: str | None = None) -> list[RequestResult]:
    """The same requests with every draft's accepted length cut to `keep` (positions >= keep never accepted), in
    requests of category `only` (all if None): a drafter that got worse from a position on."""
    out = []
    for r in rows:
        if only is not None and r.category != only:
            out.append(r)
            continue
        lengths = [min(a, keep) for a in _accepted_lengths(r)]
        out.append(synthetic_request(r.id, lengths, k=len(r.accepted_per_position), category=r.category,
                                     prompt_len=len(r.prompt_token_ids)))
    return out


def _accepted_lengths(r: RequestResult) -> list[int]:
    """Each draft step's accepted length, read back from the committed-token counts synthetic_request wrote."""
    starts = [s[0] for s in r.draft_steps]
    ends = starts[1:] + [len(r.prompt_token_ids) + len(r.output_token_ids)]
    return [end - start - 1 for start, end in zip(starts, ends)]


def as_baseline(result: Result, path, history_id: int | None = None, chosen_by: str = "result file"):
    """Save result as a baseline run's result.json and return it resolved, as `qual run --baseline` would."""
    from qual.harness.baseline import ResolvedBaseline
    from qual.result import save_result

    path = save_result(result, path)
    return ResolvedBaseline(str(path), chosen_by, history_id, path, result)
