"""Records shared by the layers: one arm's config in, per-request results and run facts out.

Neutral ground: engines, the harness, stats, results and reports all import these; this module imports nothing
of qual but the error type, the options' vocabulary and the redaction of secret env values. Records read back from files are checked
(check_record): a record no engine can produce is refused, naming it and the field.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Literal, Sequence

from typing_extensions import TypedDict  # pydantic reads its fields for the JSON Schema (typing's, before 3.12, not)

from pydantic import ConfigDict, PlainSerializer

from qual.errors import QualError
from qual.options import DEFAULT_DEVICE, DEFAULT_DTYPE
from qual.redact import redact_sections


def written_as(form: type) -> PlainSerializer:
    """Annotated metadata for a record's field that result.json writes in the shape of another record, `form` (the
    record's to_json writes it; the JSON Schema, qual/schema.py, describes it as `form`)."""
    return PlainSerializer(lambda value: value, return_type=form)


@dataclass(frozen=True)
class Sampling:
    """Sampling shared by both arms: temperature 0 is greedy."""

    temperature: float = 0.0
    """Sampling temperature: 0 is greedy (the drafter always is) [dimensionless]"""
    seed: int = 0
    """Seeds sampling and the paired bootstrap's resamples [id]"""
    max_tokens: int = 128
    """Most new tokens a request generates where its corpus row sets none [tokens]"""


@dataclass(frozen=True)
class ArmConfig:
    """Everything that defines one arm; serialised as result.json arms.<arm>.config."""

    engine: str
    """What ran the arm: reference (qual's embedded runtime), vllm (a server qual started) or attach (a server it did
    not start)"""
    model: str
    """The model profile's name"""
    dcp: int
    """Decode-context-parallel size: the ranks the target's KV cache is split across by sequence (the control's is 1)
    [count]"""
    tp: int
    """Tensor-parallel size: the ranks the arm runs on, one GPU each on cuda [count]"""
    draft_kv: str
    """The drafter's KV cache under DCP: replicated on every rank (the fix) or sharded like the target's (the legacy
    bug, docs/dflash.md); unknown where the engine cannot tell (an attached server)"""
    target_path: str
    """The target checkpoint: a local directory or a hub id"""
    draft_path: str | None
    """The drafter checkpoint: a local directory or a hub id; null without a drafter (the speedup's plain arm)"""
    num_speculative_tokens: int
    """Tokens the drafter proposes a step, K (a DFlash block is K + 1) [tokens]"""
    sampling: Sampling
    """Sampling, the same in both arms"""
    interleave: int = 1
    """Tokens a DCP rank holds in a row before the next rank's (cp_kv_cache_interleave_size) [tokens]"""
    dtype: str = DEFAULT_DTYPE
    """The floating-point type the arm computed in (torch's name)"""
    device: str = DEFAULT_DEVICE
    """Where the arm ran: cpu, cuda or cuda:N"""
    extra: dict = field(default_factory=dict)
    """Engine-specific settings from the model profile (its engine's section, max_model_len, tokenizer, chat template,
    hub revisions) and, for an attached arm, its server"""
    dsa_topk: str | None = None
    """Sparse-attention top-k under DCP: exact (the global top-k, as DCP 1 selects) or union (each rank's own); null
    where the target has no sparse attention"""
    numerics: str | None = None
    """How the target computed: exact (as written) or vllm / vllm-hopper (as vLLM's kernels compute it,
    docs/glm5.md); null where the target has one form, or the engine's build decides (vllm, attach)"""

    def to_json(self) -> dict:
        """The arm as it is written anywhere (result.json, run.json, the history): secret env values redacted."""
        return redact_sections(asdict(self))


@dataclass
class AcceptanceCounts:
    """Speculative-decoding counts of one request, or of many summed: the one spelling of each count (vLLM's
    definitions, docs/vllm.md). Every engine's counts, the statistics and the toy trainer's evaluation are these.

    drafts: verify steps that carried proposals (vLLM: num_drafts); draft_tokens: proposals verified
    (num_draft_tokens); accepted_tokens: proposals accepted (num_accepted_tokens); accepted_per_position[i]: steps
    whose proposal at position i was accepted (a proposal counts only after every one before it was).
    + and - make new counts (coverage.py's Numbers); record_step adds one verify step in place, which is what the
    runtime's host loop does for every request of every step.
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record_step(self, accepted: int, k: int) -> None:
        """One verify step of k proposals of which the first `accepted` were accepted."""
        if len(self.accepted_per_position) < k:
            self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
        self.drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def __add__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        return self._combine(other, 1)

    def __sub__(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        return self._combine(other, -1)

    def _combine(self, other: "AcceptanceCounts", sign: int) -> "AcceptanceCounts":
        k = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine, theirs = self.padded(k).accepted_per_position, other.padded(k).accepted_per_position
        return AcceptanceCounts(self.drafts + sign * other.drafts, self.draft_tokens + sign * other.draft_tokens,
                                self.accepted_tokens + sign * other.accepted_tokens,
                                [a + sign * b for a, b in zip(mine, theirs)])

    def padded(self, k: int) -> "AcceptanceCounts":
        """The same counts over exactly k positions (zeros where there are fewer, the first k where more)."""
        per = list(self.accepted_per_position[:k]) + [0] * max(0, k - len(self.accepted_per_position))
        return AcceptanceCounts(self.drafts, self.draft_tokens, self.accepted_tokens, per)

    def result_fields(self) -> dict:
        """These counts as a RequestResult's fields (its JSON line keeps them flat)."""
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position)}

    @property
    def rate(self) -> float | None:
        """Accepted / draft tokens (None before any draft)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: the tokens a verify step commits on average (None before any draft)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None


@dataclass(frozen=True)
class EngineRequest:
    """A corpus request after tokenization: both arms receive identical token ids (a later turn of a conversation:
    the ids of the arm's own conversation so far, qual.harness.turns)."""

    id: str
    category: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    turn: int = 1  # of a conversation; a prompt is one turn
    conversation: str | None = None  # the corpus row's id where it has several turns


class RequestLatency(TypedDict):
    """When one request's tokens came, in seconds from its arrival (docs/statistics.md, "Latency").

    Measured with time.perf_counter where qual drives the engine: the embedded runtime's rank 0, or the vLLM client.
    """

    ttft_s: float | None
    """Arrival to its first token; null where the reply came whole (not streamed) [seconds]"""
    tpot_s: float | None
    """(last token - first token) / (output tokens - 1); null with one token, or a reply not streamed [seconds]"""
    e2e_s: float
    """Arrival to finished: its last token committed (a stream: its end) [seconds]"""
    queued_s: float | None
    """Arrival to admitted (its prefill sent), where the engine schedules requests itself; else null [seconds]"""
    step_times_s: list[float]
    """Arrival to each step's tokens (a streamed chunk), the first token's step first [seconds]"""
    decode_steps_s: float | None
    """Of the time from its first token to its last, what its decode steps took: the embedded runtime leaves out what it
    did between runs of decode steps (admitting and prefilling other requests), a stream counts it all; null with
    fewer than two steps [seconds]"""


def _seconds(x: float) -> float:
    return round(x, 6)  # microseconds: what perf_counter resolves meaningfully here


def measured_latency(arrival: float, step_times: Sequence[float], finished: float, output_tokens: int,
                     admitted: float | None = None, decode_steps_s: float | None = None) -> RequestLatency:
    """A request's latency record from absolute perf_counter times: its arrival, when each step's tokens came (none:
    an unstreamed reply), when it finished, when it was admitted and what its decode steps took, where the engine
    says (else all of its first to last token)."""
    steps = [_seconds(t - arrival) for t in step_times]
    tpot = (steps[-1] - steps[0]) / (output_tokens - 1) if steps and output_tokens > 1 else None
    span = steps[-1] - steps[0] if len(steps) > 1 else None
    in_steps = None if span is None else min(span, _seconds(decode_steps_s)) if decode_steps_s is not None else span
    return RequestLatency(ttft_s=steps[0] if steps else None, tpot_s=_seconds(tpot) if tpot is not None else None,
                          e2e_s=_seconds(finished - arrival),
                          queued_s=_seconds(admitted - arrival) if admitted is not None else None, step_times_s=steps,
                          decode_steps_s=_seconds(in_steps) if in_steps is not None else None)


@dataclass
class RequestResult:
    """One request's outcome in one arm (a line of result.json per_request)."""

    id: str
    """The request's id: its corpus row's, or for a later turn of a conversation the turn's own"""
    category: str
    """Its corpus row's category"""
    prompt_token_ids: list[int]
    """The prompt as both arms received it (qual tokenizes once) [id]"""
    output_token_ids: list[int]
    """The tokens the target committed [id]"""
    drafts: int
    """Verify steps that carried proposals (vLLM's num_drafts) [count]"""
    draft_tokens: int
    """Proposals verified: drafts x K (vLLM's num_draft_tokens) [tokens]"""
    accepted_tokens: int
    """Proposals accepted (vLLM's num_accepted_tokens) [tokens]"""
    accepted_per_position: list[int]
    """Per draft position i, the steps whose proposal at i was accepted (a proposal counts only after every one before
    it was) [count]"""
    finish_reason: str = "length"
    """length (max_tokens reached) or stop (an end-of-sequence token)"""
    draft_steps: list[list] = field(default_factory=list)
    """Each draft step as [tokens committed when it was made, its proposed token ids]: the comparison finds draft steps
    taken at identical context; empty where the engine does not say"""
    top2_margins: list[float] | None = None
    """Per output token, the target's top-1 minus top-2 logit, where the engine can say (the near-tie analysis); else
    null [logits]"""
    acceptance_source: str | None = None
    """Where the counts came from where the engine had a choice: per_request_metrics (the server's reply) or
    metrics_diff (/metrics counters before and after, one request at a time); null: the engine counted them itself"""
    latency: RequestLatency | None = None
    """When its tokens came; null where the engine did not measure it (results and journals written before qual did)"""
    turn: int = 1
    """The turn of a conversation this request was, 1 for a prompt [index]"""
    conversation: str | None = None
    """The conversation's corpus id where it has several turns; else null"""

    @property
    def counts(self) -> AcceptanceCounts:
        return AcceptanceCounts(self.drafts, self.draft_tokens, self.accepted_tokens, list(self.accepted_per_position))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict, num_speculative_tokens: int | None = None) -> "RequestResult":
        """A record read back (journal, result.json), checked by check_record: RecordError if impossible."""
        if not isinstance(data, dict):
            raise RecordError(f"a request record must be an object (got {type(data).__name__})")
        rid = data.get("id")
        who = f"request {rid}" if isinstance(rid, str) else "a request record"
        names = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(data) - names), sorted(n for n in _REQUIRED if n not in data)
        if unknown or missing:
            raise RecordError(f"{who}: " + (f"unknown field {unknown[0]!r}" if unknown else f"missing field {missing[0]!r}"))
        rec = cls(**data)
        check_record(rec, num_speculative_tokens)
        return rec


class RecordError(QualError):
    """A per-request record that no engine can have produced (edited by hand, or corrupt): exit 2."""


_REQUIRED = ("id", "category", "prompt_token_ids", "output_token_ids", "drafts", "draft_tokens", "accepted_tokens",
             "accepted_per_position")
FINISH_REASONS = ("length", "stop")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(xs) -> bool:
    return isinstance(xs, list) and all(_is_int(x) and x >= 0 for x in xs)


def check_record(r: RequestResult, num_speculative_tokens: int | None = None) -> None:
    """The invariants every engine's records obey (vLLM's definitions, docs/vllm.md); RecordError naming the field.

    K drafts per step (K = len(accepted_per_position), the arm's num_speculative_tokens where known); greedy
    acceptance is a prefix, so position i is accepted in at most as many steps as position i - 1; a request's
    tokens are its prefill's one plus, per verify step, 1 to accepted + 1 (the last step may be cut short).
    """
    who = f"request {r.id}"
    for name in ("id", "category", "finish_reason"):
        if not isinstance(getattr(r, name), str) or not getattr(r, name):
            raise RecordError(f"{who}: {name} must be a non-empty string")
    if r.finish_reason not in FINISH_REASONS:
        raise RecordError(f"{who}: finish_reason {r.finish_reason!r} is not one of {', '.join(FINISH_REASONS)}")
    for name in ("prompt_token_ids", "output_token_ids", "accepted_per_position"):
        if not _ints(getattr(r, name)):
            raise RecordError(f"{who}: {name} must be a list of token counts/ids >= 0")
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        if not _is_int(getattr(r, name)) or getattr(r, name) < 0:
            raise RecordError(f"{who}: {name} must be an integer >= 0 (got {getattr(r, name)!r})")
    if not r.prompt_token_ids:
        raise RecordError(f"{who}: prompt_token_ids is empty")
    k, per_pos, n = len(r.accepted_per_position), r.accepted_per_position, len(r.output_token_ids)
    if num_speculative_tokens is not None and k not in (0, num_speculative_tokens):
        raise RecordError(f"{who}: accepted_per_position has {k} positions, the arm drafts {num_speculative_tokens}")
    if r.draft_tokens != r.drafts * k:
        raise RecordError(f"{who}: draft_tokens {r.draft_tokens} != drafts {r.drafts} x {k} positions")
    if r.accepted_tokens > r.draft_tokens:
        raise RecordError(f"{who}: accepted_tokens {r.accepted_tokens} > draft_tokens {r.draft_tokens}")
    if sum(per_pos) != r.accepted_tokens:
        raise RecordError(f"{who}: accepted_per_position sums to {sum(per_pos)}, accepted_tokens is {r.accepted_tokens}")
    if per_pos and per_pos[0] > r.drafts:
        raise RecordError(f"{who}: accepted_per_position[0] {per_pos[0]} > drafts {r.drafts}")
    for i in range(1, k):
        if per_pos[i] > per_pos[i - 1]:
            raise RecordError(f"{who}: accepted_per_position[{i}] {per_pos[i]} > [{i - 1}] {per_pos[i - 1]} "
                              "(acceptance is a prefix: it cannot grow along the block)")
    if n < 1:
        raise RecordError(f"{who}: output_token_ids is empty")
    if k and not r.drafts + 1 <= n <= 1 + r.drafts + r.accepted_tokens:
        raise RecordError(f"{who}: {n} output tokens cannot come from {r.drafts} verify steps accepting "
                          f"{r.accepted_tokens} drafts (between {r.drafts + 1} and {1 + r.drafts + r.accepted_tokens})")
    if r.draft_steps:
        if len(r.draft_steps) != r.drafts:
            raise RecordError(f"{who}: draft_steps has {len(r.draft_steps)} steps, drafts is {r.drafts}")
        for j, step in enumerate(r.draft_steps):
            if not (isinstance(step, list) and len(step) == 2 and _is_int(step[0]) and _ints(step[1]) and len(step[1]) == k):
                raise RecordError(f"{who}: draft_steps[{j}] must be [committed tokens, {k} proposed ids]")
    if r.top2_margins is not None and (not isinstance(r.top2_margins, list) or len(r.top2_margins) != n):
        raise RecordError(f"{who}: top2_margins must hold one margin per output token ({n})")
    if not _is_int(r.turn) or r.turn < 1:
        raise RecordError(f"{who}: turn must be an integer >= 1 (got {r.turn!r})")
    if r.conversation is not None and (not isinstance(r.conversation, str) or not r.conversation):
        raise RecordError(f"{who}: conversation must be a non-empty string or null")
    if r.latency is not None:
        _check_latency(r.latency, n, who)


def _seconds_ok(x, optional: bool = False) -> bool:
    if x is None:
        return optional
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _check_latency(lat, n: int, who: str) -> None:
    """A latency record as measured_latency writes it: seconds >= 0, steps in order, none after the end, at most one
    step a token, the first token at the first step."""
    if not isinstance(lat, dict) or set(lat) != set(RequestLatency.__annotations__):
        raise RecordError(f"{who}: latency must hold exactly {', '.join(RequestLatency.__annotations__)}")
    steps = lat["step_times_s"]
    if not isinstance(steps, list) or not all(_seconds_ok(t) for t in steps):
        raise RecordError(f"{who}: latency.step_times_s must be a list of seconds >= 0")
    for name in ("ttft_s", "tpot_s", "queued_s", "e2e_s", "decode_steps_s"):
        if not _seconds_ok(lat[name], optional=name != "e2e_s"):
            raise RecordError(f"{who}: latency.{name} must be seconds >= 0{'' if name == 'e2e_s' else ' or null'}")
    if len(steps) > n or any(b < a for a, b in zip(steps, steps[1:])) or (steps and steps[-1] > lat["e2e_s"]):
        raise RecordError(f"{who}: latency.step_times_s must be at most one step per output token ({n}), in order, "
                          f"none after e2e_s")
    if lat["ttft_s"] != (steps[0] if steps else None):
        raise RecordError(f"{who}: latency.ttft_s must be the first step's time (null without steps)")
    if (lat["decode_steps_s"] is None) != (len(steps) < 2) or (
            len(steps) > 1 and lat["decode_steps_s"] > steps[-1] - steps[0] + 1e-6):
        raise RecordError(f"{who}: latency.decode_steps_s must be at most its first to last step's seconds (null with "
                          "fewer than two steps)")


@dataclass
class GraphCapture:
    """CUDA-graph capture record of one arm."""

    status: str = "unsupported"
    """captured, failed, unsupported, or not_observed (an attached server captured before qual saw it)"""
    mode: str | None = None
    """The capture mode as the engine names it (FULL_DECODE_ONLY, FULL_AND_PIECEWISE, ...); null without one"""
    sizes: list[int] = field(default_factory=list)
    """The batch sizes captured (decode rows; vLLM's capture sizes are tokens) [count]"""
    seconds: float | None = None
    """What the capture took [seconds]"""
    bytes: int | None = None
    """Memory the capture added: the caching allocator's reserved bytes (graph pool and static buffers), measured from
    an emptied cache [bytes]"""
    eager_fallback_sizes: list[int] = field(default_factory=list)
    """Sizes that run eagerly although the mode asks for graphs (a mode logged while decode runs eager) [count]"""
    detail: str | None = None
    """Why not captured, or what the engine said about it"""
    backend: dict | None = None
    """The engine's kernel backend and the steps each part serves, where the engine says"""
    prefill: dict | None = None
    """Prefill at padded shapes and its CUDA graphs (status, buckets, replays, eager chunks, seconds, detail), where the
    engine says"""


# An attached server's start-up (where vLLM captures its graphs) happened before qual saw it: its capture is not
# observed, neither captured nor unsupported. The gate's graph check skips such an arm rather than guess.
GRAPH_NOT_OBSERVED = "not_observed"


@dataclass
class HostFacts:
    """The machine a process ran on, as far as it can tell (None where it cannot)."""

    hostname: str | None = None
    """The machine's name"""
    platform: str | None = None
    """Its operating system and architecture"""
    python: str | None = None
    """The Python version"""
    torch: str | None = None
    """The torch version"""
    cuda: str | None = None
    """The CUDA runtime torch was built with; null on a CPU build"""
    gpus: list[str] = field(default_factory=list)
    """The device names, one per visible GPU"""
    gpu_driver: str | None = None
    """The NVIDIA driver's version"""
    cpu_model: str | None = None
    """The CPU's model name"""
    source: str = "this process"
    """How these facts were learned (this process, a server's /server_info)"""


@dataclass
class EngineBuild:
    """Which engine build ran an arm, where, and with what command or configuration."""

    name: str
    """The engine: reference, vllm or attach"""
    version: str | None = None
    """The engine's version (qual's for the embedded runtime, vLLM's release)"""
    commit: str | None = None
    """The build's git commit; null where it records none"""
    host: HostFacts | None = None
    """Where the engine ran; null where nothing says (an attached server without /server_info)"""
    server_command: str | None = None
    """The exact server command, secrets redacted (a server qual launched)"""
    runtime_config: dict | None = None
    """The configuration the engine ran with, as it states it"""
    reported: dict = field(default_factory=dict)
    """What a server said about itself (parallel layout, speculative config, ...)"""
    source: str = ""
    """Where these facts came from"""

    @classmethod
    def from_json(cls, data: dict) -> "EngineBuild":
        data = dict(data)
        host = data.pop("host", None)
        return cls(**data, host=HostFacts(**host) if isinstance(host, dict) else None)


@dataclass
class ArmRunInfo:
    """What an engine reports about a finished arm besides per-request results."""

    engine_version: str
    graph_capture: GraphCapture
    wall_seconds: float
    output_tokens: int
    log_path: str | None = None
    runnable: bool = True
    not_runnable_reason: str | None = None
    extra: dict = field(default_factory=dict)  # engine-specific facts (e.g. KV memory per rank)
    # Seconds spent generating, without the engine's start-up (loading, graph capture), where the engine can tell.
    # The first arm of a process pays one-time CUDA costs at start-up: wall_seconds alone would favour the second.
    generate_seconds: float | None = None
    build: EngineBuild | None = None  # the engine build that ran the arm (provenance), where the engine says

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0


OnResult = Callable[[RequestResult], None]


@dataclass
class DoctorCheck:
    """One line of `qual doctor`: a verdict (yes/no/unknown) with what it rests on; `qual doctor --json` prints a list
    of these (its JSON Schema: `qual schema --doctor`)."""

    __pydantic_config__ = ConfigDict(use_attribute_docstrings=True)  # each field's docstring: its description

    name: str
    """What is checked (Python, torch, GPUs, an engine's install, run); a line that belongs to the check above it
    starts with two spaces"""
    verdict: Literal["yes", "no", "unknown"]
    """yes: present and usable; no: absent or unusable (--strict exits 1 on a no the run needs); unknown: could not
    be told"""
    detail: str
    """The line doctor prints beside the verdict"""
    evidence: list[str] = field(default_factory=list)
    """What the verdict rests on (doctor -v prints it, and prints it for every verdict that is not yes)"""
    install: str | None = None
    """Which install the check is about (the label of its engine's first line); null for a check of the machine"""
    needed: bool = True
    """Whether the run doctor checks needs it: --strict fails on a no that is needed; another is shown, not counted"""
