"""Acceptance math and paired comparisons of two arms (pure functions, docs/statistics.md).

Rates are fractions in [0, 1] everywhere here; percentage points appear only in
gate details and reports. An undefined ratio (nothing drafted, nothing to
compare) is None, never 0 and never NaN, so that "no drafter ran" cannot pass
for "no token was accepted".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from typing_extensions import TypedDict  # as qual.records says

import numpy as np

from qual.records import AcceptanceCounts, RequestResult
from qual.errors import QualError
from qual.intervals import DEFAULT_RESAMPLES, Resamples, bounds_of_each, estimate, resample
from qual.latency import decode_span

# Target top-1 minus top-2 logit below which a flipped greedy token counts as a
# reduced-precision near tie rather than a disagreement (docs/statistics.md).
DEFAULT_NEAR_TIE_MARGIN = 0.1


def ci_key(confidence: float) -> str:
    """How a confidence level keys an interval in result.json: 0.95 -> "0.95"."""
    return f"{confidence:g}"


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


class AcceptanceJson(TypedDict):
    """One arm's acceptance, summed over requests (vLLM's definitions)."""

    rate: float | None
    """Accepted / draft tokens: the acceptance rate [fraction]"""
    mean_acceptance_length: float | None
    """1 + accepted / drafts: the tokens a verify step commits on average [tokens]"""
    drafts: int
    """Verify steps that carried proposals [count]"""
    draft_tokens: int
    """Proposals verified [tokens]"""
    accepted_tokens: int
    """Proposals accepted [tokens]"""
    accepted_per_position: list[int]
    """Per draft position i, the steps whose proposal at i was accepted [count]"""
    per_position: list[float | None]
    """Per draft position i, accepted at i / drafts (vLLM's, unconditional) [fraction]"""
    per_position_conditional: list[float | None]
    """Per draft position i, accepted at i / accepted at i - 1 (position 0: / drafts) [fraction]"""


@dataclass(frozen=True)
class Acceptance:
    """One arm's acceptance: its counts summed over requests, and the rates derived from them (vLLM's definitions);
    result.json arms.<arm>.acceptance."""

    counts: AcceptanceCounts

    @property
    def rate(self) -> float | None:  # accepted / draft tokens
        return self.counts.rate

    @property
    def mean_acceptance_length(self) -> float | None:  # 1 + accepted / drafts
        return self.counts.mean_acceptance_length

    @property
    def drafts(self) -> int:
        return self.counts.drafts

    @property
    def draft_tokens(self) -> int:
        return self.counts.draft_tokens

    @property
    def accepted_tokens(self) -> int:
        return self.counts.accepted_tokens

    @property
    def accepted_per_position(self) -> list[int]:
        return list(self.counts.accepted_per_position)

    @property
    def per_position(self) -> list[float | None]:
        """accepted at position i / drafts."""
        return [_ratio(n, self.drafts) for n in self.counts.accepted_per_position]

    @property
    def per_position_conditional(self) -> list[float | None]:
        """accepted at i / accepted at i - 1: position i can only be accepted where i - 1 was (i = 0: / drafts)."""
        per = self.counts.accepted_per_position
        return self.per_position[:1] + [_ratio(per[i], per[i - 1]) for i in range(1, len(per))]

    def to_json(self) -> AcceptanceJson:
        return {"rate": self.rate, "mean_acceptance_length": self.mean_acceptance_length, "drafts": self.drafts,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_position": self.accepted_per_position, "per_position": self.per_position,
                "per_position_conditional": self.per_position_conditional}

    @classmethod
    def from_json(cls, data: dict) -> "Acceptance":
        """The counts of a result.json's acceptance (the rates there are derived from them, and derived again)."""
        return cls(AcceptanceCounts(data["drafts"], data["draft_tokens"], data["accepted_tokens"],
                                    list(data["accepted_per_position"])))


def acceptance_summary(requests: Sequence[RequestResult]) -> Acceptance:
    """The requests' counts summed, with the rates derived."""
    return Acceptance(sum((r.counts for r in requests), AcceptanceCounts()))


def pair_requests(
    control: Sequence[RequestResult], candidate: Sequence[RequestResult]
) -> tuple[list[RequestResult], list[RequestResult]]:
    """Order candidate results like control's and verify the replay was matched: identical prompts, except where a
    later turn of a conversation holds each arm's own earlier answers (earlier_turns_differ)."""
    for arm, rows in (("control", control), ("candidate", candidate)):
        seen: set[str] = set()
        for r in rows:
            if r.id in seen:
                raise QualError(f"{arm} arm has duplicate request id {r.id!r}")
            seen.add(r.id)
    by_id = {r.id: r for r in candidate}
    only_control = [r.id for r in control if r.id not in by_id]
    control_ids = {r.id for r in control}
    only_candidate = [r.id for r in candidate if r.id not in control_ids]
    if only_control or only_candidate:
        raise QualError(
            "arms did not replay the same requests: "
            f"only in control {only_control[:5]}, only in candidate {only_candidate[:5]}"
        )
    paired = [by_id[r.id] for r in control]
    for a, b in zip(control, paired):
        if a.turn != b.turn:
            raise QualError(f"request {a.id!r}: turn {a.turn} in control, {b.turn} in candidate (replay not matched)")
        if a.turn == 1 and list(a.prompt_token_ids) != list(b.prompt_token_ids):
            raise QualError(f"request {a.id!r}: prompt token ids differ between arms (replay not matched)")
    return list(control), paired


def history_differs(c: RequestResult, k: RequestResult) -> bool:
    """A later turn whose prompts differ between the arms: an earlier answer of the conversation differed (a
    target-output difference of that earlier turn, where it is counted), so this turn's outputs are not compared."""
    return c.turn > 1 and list(c.prompt_token_ids) != list(k.prompt_token_ids)


def earlier_turns_differ(control: Sequence[RequestResult], candidate: Sequence[RequestResult]) -> list[str]:
    """Ids of the paired requests whose earlier turns differ between the arms (history_differs)."""
    return [c.id for c, k in zip(control, candidate) if history_differs(c, k)]


def pair_by_id(
    reference: Sequence[RequestResult], tonight: Sequence[RequestResult]
) -> tuple[list[RequestResult], list[RequestResult], list[str]]:
    """The reference's rows in tonight's order, matched by request id (an earlier run of the same corpus).

    Every request of tonight must be in the reference, which may hold more (a longer --limit). Prompt token ids
    are not required to agree: a tokenizer change is one of the regressions a baseline exists to catch, so the ids
    of first-turn requests tokenized differently are returned instead (third element).
    """
    for arm, rows in (("baseline", reference), ("tonight's", tonight)):
        seen: set[str] = set()
        for r in rows:
            if r.id in seen:
                raise QualError(f"{arm} arm has duplicate request id {r.id!r}")
            seen.add(r.id)
    by_id = {r.id: r for r in reference}
    missing = [r.id for r in tonight if r.id not in by_id]
    if missing:
        raise QualError(f"{len(missing)} of {len(tonight)} requests are not in the baseline (first: {missing[:3]})")
    paired = [by_id[r.id] for r in tonight]
    # a later turn's prompt holds the run's own earlier answers: a difference there is theirs, not the tokenizer's
    retokenized = [t.id for b, t in zip(paired, tonight)
                   if t.turn == 1 and list(b.prompt_token_ids) != list(t.prompt_token_ids)]
    return paired, list(tonight), retokenized


# ---------------------------------------------------------------- bootstrap


class PositionInterval(TypedDict):
    """One draft position's rates in both arms and candidate - control, each with its 95% interval (qual.intervals).

    Unconditional: accepted at i / drafts; conditional: accepted at i / accepted at i - 1 (position 0: / drafts).
    """

    position: int
    """The draft position, from 0 [index]"""
    control: float | None
    """The control's rate at it: accepted at i / drafts [fraction]"""
    candidate: float | None
    """The candidate's rate at it [fraction]"""
    delta: float | None
    """candidate - control [fraction]"""
    ci: list[float] | None
    """delta's 95% interval [fraction]"""
    control_ci: list[float] | None
    """The control rate's 95% interval [fraction]"""
    candidate_ci: list[float] | None
    """The candidate rate's 95% interval [fraction]"""
    control_conditional: float | None
    """The control's conditional rate: accepted at i / accepted at i - 1 [fraction]"""
    candidate_conditional: float | None
    """The candidate's conditional rate [fraction]"""
    delta_conditional: float | None
    """candidate_conditional - control_conditional [fraction]"""
    conditional_ci: list[float] | None
    """delta_conditional's 95% interval [fraction]"""
    control_conditional_ci: list[float] | None
    """The control's conditional rate's 95% interval [fraction]"""
    candidate_conditional_ci: list[float] | None
    """The candidate's conditional rate's 95% interval [fraction]"""


@dataclass(frozen=True)
class PairedBootstrap:
    """Point deltas (candidate - control) and their intervals from a paired bootstrap over requests (qual.intervals:
    confidence -> (lo, hi), None where undefined); per_position comes from the same resamples."""

    n_requests: int  # resampling units: requests, or conversations where a request is one turn of one
    n_resamples: int
    seed: int
    delta_rate: float | None
    delta_rate_ci: dict[float, tuple[float, float] | None]  # confidence -> (lo, hi)
    delta_mean_acceptance_length: float | None
    delta_mean_acceptance_length_ci: dict[float, tuple[float, float] | None] = field(default_factory=dict)
    per_position: list[PositionInterval] = field(default_factory=list)


# Columns of the per-request matrix the bootstrap resamples; the per-position counts follow them (control's K, then
# candidate's K).
PAIRED_COLUMNS = ("control accepted", "control draft tokens", "control drafts",
                  "candidate accepted", "candidate draft tokens", "candidate drafts")
_C_ACC, _C_TOK, _C_DRAFTS, _K_ACC, _K_TOK, _K_DRAFTS = range(len(PAIRED_COLUMNS))
_POOLED = len(PAIRED_COLUMNS)
POSITION_CONFIDENCE = 0.95  # the per-position intervals' (result.json comparison.per_position, the report's whiskers)


def _columns(control: Sequence[RequestResult], candidate: Sequence[RequestResult], k: int) -> np.ndarray:
    """[requests, 6 + 2K]: both arms' accepted, draft tokens, drafts, then accepted at each position."""
    out = np.zeros((len(control), _POOLED + 2 * k), dtype=np.float64)
    for i, (c, kk) in enumerate(zip(control, candidate)):
        out[i, :_POOLED] = (c.accepted_tokens, c.draft_tokens, c.drafts, kk.accepted_tokens, kk.draft_tokens, kk.drafts)
        for base, r in ((_POOLED, c), (_POOLED + k, kk)):
            n = min(k, len(r.accepted_per_position))
            out[i, base:base + n] = r.accepted_per_position[:n]
    return out


def _div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, NaN where den is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def delta_rate_of(s: np.ndarray) -> np.ndarray:
    """Candidate - control acceptance rate for each row of sums of the PAIRED_COLUMNS ([rows, >= 6]); NaN where
    undefined."""
    return _div(s[:, _K_ACC], s[:, _K_TOK]) - _div(s[:, _C_ACC], s[:, _C_TOK])


def delta_mean_acceptance_length_of(s: np.ndarray) -> np.ndarray:
    """Candidate - control mean acceptance length for each row of sums of the PAIRED_COLUMNS (the 1 + of both
    cancels); NaN where undefined."""
    return _div(s[:, _K_ACC], s[:, _K_DRAFTS]) - _div(s[:, _C_ACC], s[:, _C_DRAFTS])


def _position_rates(s: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """Each arm's unconditional and conditional rate per position, and their deltas: [rows, K] each."""
    out = {}
    for arm, base, drafts in (("control", _POOLED, _C_DRAFTS), ("candidate", _POOLED + k, _K_DRAFTS)):
        acc = s[:, base:base + k]  # [rows, K]
        uncond = _div(acc, s[:, drafts:drafts + 1])
        reached = np.concatenate([s[:, drafts:drafts + 1], acc[:, :-1]], axis=1)  # position 0: every draft
        out[arm], out[f"{arm}_conditional"] = uncond, _div(acc, reached)
    out["delta"] = out["candidate"] - out["control"]
    out["delta_conditional"] = out["candidate_conditional"] - out["control_conditional"]
    return out


def _positions(columns: np.ndarray, sums: Resamples | None, k: int) -> list[PositionInterval]:
    """Per position: the rates of all requests, and intervals from the resampled sums (none without them)."""
    point = _position_rates(columns.sum(axis=0, keepdims=True), k)
    cis: dict[str, list] = {}
    if sums is not None:
        spread, left_out = _position_rates(sums.resampled, k), _position_rates(sums.left_out, k)
        cis = {key: bounds_of_each(spread[key], left_out[key], POSITION_CONFIDENCE) for key in spread}

    def value(key: str, i: int) -> float | None:
        x = point[key][0, i]
        return float(x) if np.isfinite(x) else None

    def ci(key: str, i: int) -> list[float] | None:
        interval = cis[key][i] if cis else None
        return list(interval) if interval is not None else None

    return [PositionInterval(
        position=i, control=value("control", i), candidate=value("candidate", i), delta=value("delta", i),
        ci=ci("delta", i), control_ci=ci("control", i), candidate_ci=ci("candidate", i),
        control_conditional=value("control_conditional", i), candidate_conditional=value("candidate_conditional", i),
        delta_conditional=value("delta_conditional", i), conditional_ci=ci("delta_conditional", i),
        control_conditional_ci=ci("control_conditional", i), candidate_conditional_ci=ci("candidate_conditional", i),
    ) for i in range(k)]


def _by_unit(columns: np.ndarray, rows: Sequence[RequestResult]) -> np.ndarray:
    """The rows of the turns of one conversation summed into one (a conversation's turns share their history, so
    the conversation is what is resampled); unchanged where every request is its own unit."""
    units = [r.conversation or f"\0{r.id}" for r in rows]  # "\0": no conversation id collides with a request id
    if len(set(units)) == len(units):
        return columns
    index: dict[str, int] = {}
    for u in units:
        index.setdefault(u, len(index))
    out = np.zeros((len(index), columns.shape[1]), dtype=columns.dtype)
    np.add.at(out, [index[u] for u in units], columns)
    return out


def paired_bootstrap(
    control: Sequence[RequestResult],
    candidate: Sequence[RequestResult],
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidences: Sequence[float] = (0.95,),
) -> PairedBootstrap:
    """Resample request indices (same indices for both arms; a conversation's turns together) and take intervals
    (qual.intervals) of the ratio-of-sums deltas: the pooled rate and mean acceptance length at each of
    `confidences`, each draft position's rates at POSITION_CONFIDENCE.

    `control[i]` and `candidate[i]` must be the same request (see pair_requests).
    """
    if len(control) != len(candidate):
        raise QualError(f"paired bootstrap needs equal arms, got {len(control)} and {len(candidate)} requests")
    if n_resamples < 1:
        raise QualError(f"bootstrap resamples must be >= 1, got {n_resamples}")
    k = max((len(r.accepted_per_position) for r in (*control, *candidate)), default=0)
    columns = _by_unit(_columns(control, candidate, k), control)
    total = columns.sum(axis=0)
    rate_c, rate_k = _ratio(total[_C_ACC], total[_C_TOK]), _ratio(total[_K_ACC], total[_K_TOK])
    mal_c, mal_k = _ratio(total[_C_ACC], total[_C_DRAFTS]), _ratio(total[_K_ACC], total[_K_DRAFTS])
    d_rate = rate_k - rate_c if rate_c is not None and rate_k is not None else None
    d_mal = mal_k - mal_c if mal_c is not None and mal_k is not None else None
    if len(control) == 0 or d_rate is None:
        empty = {float(c): None for c in confidences}
        return PairedBootstrap(columns.shape[0], n_resamples, seed, d_rate, empty, d_mal, dict(empty),
                               _positions(columns, None, k))
    sums = resample(columns, n_resamples, seed)
    return PairedBootstrap(
        n_requests=columns.shape[0],
        n_resamples=n_resamples,
        seed=seed,
        delta_rate=d_rate,
        delta_rate_ci={float(c): estimate(sums, delta_rate_of, c).bounds for c in confidences},
        delta_mean_acceptance_length=d_mal,
        delta_mean_acceptance_length_ci={float(c): estimate(sums, delta_mean_acceptance_length_of, c).bounds
                                         for c in confidences},
        per_position=_positions(columns, sums, k),
    )


@dataclass(frozen=True)
class SpeedupInterval:
    """Decode tokens/s of the speculative arm and of plain decoding, their ratio, and the ratio's intervals from a
    paired bootstrap over requests (qual.intervals; docs/statistics.md "Speedup")."""

    n_requests: int  # paired requests whose decode both arms timed
    n_resamples: int
    seed: int
    speculative_rate: float | None  # sum of (tokens - 1) / sum of (last token - first token) seconds
    plain_rate: float | None
    ratio: float | None  # speculative_rate / plain_rate
    ratio_ci: dict[float, tuple[float, float] | None] = field(default_factory=dict)


def decode_speedup(
    speculative: Sequence[RequestResult],
    plain: Sequence[RequestResult],
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidences: Sequence[float] = (0.95,),
) -> SpeedupInterval:
    """Each arm's decode rate as a ratio of sums over requests (tokens after the first / seconds from the first token
    to the last) and speculative / plain, with intervals (qual.intervals) from resampling request indices (the same
    for both arms). Requests either arm did not time (one token, an unstreamed reply) are left out of both.

    `speculative[i]` and `plain[i]` must be the same request (see pair_requests).
    """
    if len(speculative) != len(plain):
        raise QualError(f"paired bootstrap needs equal arms, got {len(speculative)} and {len(plain)} requests")
    if n_resamples < 1:
        raise QualError(f"bootstrap resamples must be >= 1, got {n_resamples}")
    rows = [(*a[:2], *b[:2]) for a, b in ((decode_span(s), decode_span(p)) for s, p in zip(speculative, plain))
            if a is not None and b is not None]
    columns = np.asarray(rows, dtype=np.float64).reshape(len(rows), 4)  # [requests, (tokens, seconds) x 2 arms]
    total = columns.sum(axis=0)
    spec, base = _ratio(total[0], total[1]), _ratio(total[2], total[3])
    ratio = spec / base if spec is not None and base else None
    if ratio is None:
        return SpeedupInterval(len(rows), n_resamples, seed, spec, base, None, {float(c): None for c in confidences})
    sums = resample(columns, n_resamples, seed)
    return SpeedupInterval(len(rows), n_resamples, seed, spec, base, ratio,
                           {float(c): estimate(sums, _speedup_ratio, c).bounds for c in confidences})


def _speedup_ratio(s: np.ndarray) -> np.ndarray:
    """(speculative tokens / seconds) / (plain tokens / seconds) for each row of column sums; NaN where undefined."""
    return _div(_div(s[:, 0], s[:, 1]), _div(s[:, 2], s[:, 3]))


# ---------------------------------------------------------------- per request / category


def _request_rate(r: RequestResult) -> float | None:
    return _ratio(r.accepted_tokens, r.draft_tokens)


def per_request_deltas(control: Sequence[RequestResult], candidate: Sequence[RequestResult]) -> list[dict]:
    """Per paired request: both rates and candidate - control (None where nothing was drafted); a later turn of a
    conversation says its turn, and whether its earlier turns differ between the arms."""
    rows = []
    for c, k in zip(control, candidate):
        rc, rk = _request_rate(c), _request_rate(k)
        row = {
            "id": c.id,
            "category": c.category,
            "control_rate": rc,
            "candidate_rate": rk,
            "delta": rk - rc if rc is not None and rk is not None else None,
        }
        if c.turn > 1 or c.conversation is not None:
            row.update(turn=c.turn, earlier_turns_differ=history_differs(c, k))
        rows.append(row)
    return rows


def per_turn(control: Sequence[RequestResult], candidate: Sequence[RequestResult]) -> list[dict]:
    """Ratio-of-sums rates per turn of the conversations, for both arms (empty where every request is one turn),
    with how many requests of each turn had earlier turns that differ between the arms."""
    if all(c.turn == 1 and c.conversation is None for c in control):
        return []
    sums: dict[int, list[int]] = {}  # turn -> [n, control accepted, control drafted, candidate ..., history differs]
    for c, k in zip(control, candidate, strict=True):
        row = sums.setdefault(c.turn, [0] * 6)
        values = (1, c.accepted_tokens, c.draft_tokens, k.accepted_tokens, k.draft_tokens, history_differs(c, k))
        for i, v in enumerate(values):
            row[i] += v
    rows = []
    for turn, (n, c_acc, c_tok, k_acc, k_tok, differ) in sorted(sums.items()):
        rc, rk = _ratio(c_acc, c_tok), _ratio(k_acc, k_tok)
        rows.append({"turn": turn, "n": n, "control_rate": rc, "candidate_rate": rk,
                     "delta": rk - rc if rc is not None and rk is not None else None,
                     "control_draft_tokens": c_tok, "candidate_draft_tokens": k_tok, "earlier_turns_differ": differ})
    return rows


def per_category(control: Sequence[RequestResult], candidate: Sequence[RequestResult]) -> list[dict]:
    """Ratio-of-sums rates per corpus category for both arms, sorted by category."""
    if not control:
        return []
    sums: dict[str, list[int]] = {}  # category -> [n, control accepted, control drafted, candidate ...]
    for c, k in zip(control, candidate, strict=True):
        row = sums.setdefault(c.category, [0, 0, 0, 0, 0])
        for i, v in enumerate((1, c.accepted_tokens, c.draft_tokens, k.accepted_tokens, k.draft_tokens)):
            row[i] += v
    rows = []
    for category, (n, c_acc, c_tok, k_acc, k_tok) in sorted(sums.items()):
        rc, rk = _ratio(c_acc, c_tok), _ratio(k_acc, k_tok)
        rows.append(
            {
                "category": category,
                "n": n,
                "control_rate": rc,
                "candidate_rate": rk,
                "delta": rk - rc if rc is not None and rk is not None else None,
                "control_draft_tokens": c_tok,
                "candidate_draft_tokens": k_tok,
            }
        )
    return rows


# ---------------------------------------------------------------- divergence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _margin_at(r: RequestResult, i: int) -> float | None:
    m = r.top2_margins
    return float(m[i]) if m is not None and i < len(m) and m[i] is not None else None


def compare_outputs(
    control: Sequence[RequestResult],
    candidate: Sequence[RequestResult],
    near_tie_margin: float = DEFAULT_NEAR_TIE_MARGIN,
) -> list[dict]:
    """Per paired request whose target outputs differ: where, the top-2 margin there, and a verdict.

    The margin is the smaller of the two arms' target top-1 minus top-2 logits
    at the first differing output index (either arm's near tie explains a
    flip). Without any margin the flip cannot be shown benign: "disagreement".
    A later turn whose earlier turns differ is left out: its prompts differ, and
    the difference is the earlier turn's, counted there (earlier_turns_differ).
    """
    rows = []
    for c, k in zip(control, candidate):
        if list(c.output_token_ids) == list(k.output_token_ids) or history_differs(c, k):
            continue
        i = common_prefix_length(c.output_token_ids, k.output_token_ids)
        margins = [m for m in (_margin_at(c, i), _margin_at(k, i)) if m is not None]
        margin = min(margins) if margins else None
        benign = margin is not None and margin < near_tie_margin
        rows.append(
            {
                "id": c.id,
                "category": c.category,
                "first_divergence": i,
                "control_token": c.output_token_ids[i] if i < len(c.output_token_ids) else None,
                "candidate_token": k.output_token_ids[i] if i < len(k.output_token_ids) else None,
                "top2_margin": margin,
                "classification": "benign_near_tie" if benign else "disagreement",
            }
        )
    return rows


def proposal_divergence(control: Sequence[RequestResult], candidate: Sequence[RequestResult]) -> dict:
    """Fraction of draft steps taken at identical context whose proposals differ, overall and per position.

    A draft step is `[num_committed, proposals]`, num_committed counting the
    whole sequence (prompt included) when the draft was made. Steps of the
    two arms match on num_committed, and only while the committed tokens are
    still identical (up to the first target-output divergence).
    """
    matched = differing = 0
    pos_total: list[int] = []
    pos_diff: list[int] = []
    c_steps = k_steps = 0
    for c, k in zip(control, candidate):
        c_steps += len(c.draft_steps)
        k_steps += len(k.draft_steps)
        if history_differs(c, k):  # different prompts: no context is identical
            continue
        limit = len(c.prompt_token_ids) + common_prefix_length(c.output_token_ids, k.output_token_ids)
        k_by_key: dict[int, list[int]] = {}
        for key, props in k.draft_steps:
            k_by_key.setdefault(int(key), list(props))
        for key, props in c.draft_steps:
            key = int(key)
            if key > limit or key not in k_by_key:
                continue
            a, b = list(props), k_by_key[key]
            matched += 1
            differing += a != b
            for i in range(max(len(a), len(b))):
                if i >= len(pos_total):
                    pos_total.append(0)
                    pos_diff.append(0)
                pos_total[i] += 1
                pos_diff[i] += i >= len(a) or i >= len(b) or a[i] != b[i]
    return {
        "overall": _ratio(differing, matched),
        "per_position": [_ratio(d, t) for d, t in zip(pos_diff, pos_total)],
        "matched_steps": matched,
        "differing_steps": differing,
        "control_steps": c_steps,
        "candidate_steps": k_steps,
    }
