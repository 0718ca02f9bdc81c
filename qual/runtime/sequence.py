"""One request as the driver sees it while it runs: its tokens so far, its draft context and its counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from qual.records import AcceptanceCounts, RequestResult, measured_latency
from qual.runtime.spec_decode import accept


@dataclass(frozen=True)
class GenerationRequest:
    id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int | None = None
    category: str = "default"


@dataclass
class Sequence:
    """A request being generated (nano-vllm's Sequence): rank 0's bookkeeping of what the ranks computed for it."""

    req: GenerationRequest
    max_tokens: int
    K: int
    output: list[int] = field(default_factory=list)
    ctx_len: int = 0  # tokens already in the draft cache
    pending_commit: int = 0  # verified tokens whose hidden states join the draft context next step
    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    # (committed tokens when drafted, proposals) of each draft: lets a comparison find draft steps at identical context
    draft_steps: list[list] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    # Rank 0's time.perf_counter: handed to the engine, admitted (prefill sent), each step's tokens committed, finished
    arrival: float = 0.0
    admitted: float | None = None
    step_times: list[float] = field(default_factory=list)
    finished: float | None = None
    decode_steps_s: float = 0.0  # the time its decode steps took: between its steps' tokens within a decode run
    # len(req.prompt_token_ids), kept: the scheduler and the commit ask for it (through num_committed) several times a
    # row every decode launch
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.req.prompt_token_ids)

    @property
    def num_committed(self) -> int:
        return self.prompt_len + len(self.output)

    @property
    def reserved_len(self) -> int:
        """Positions the request can occupy by its end: its prompt and every token it may generate."""
        return self.prompt_len + self.max_tokens

    def record_verify(self, proposals: list[int], targets: list[int]) -> int:
        """Count one verify step of this request's proposals against the target's choices; returns how many were
        accepted (a: the step commits a + 1 target tokens)."""
        a = accept(proposals, targets)
        self.counts.record_step(a, self.K)
        self.draft_steps.append([self.num_committed, proposals])
        return a

    def append(self, tokens: list[int], margins: list[float], eos: frozenset[int], now: float = 0.0,
               decoding_since: float | None = None) -> None:
        """Commit verified tokens in order until max_tokens, or an EOS token (which is kept). `now`: when the host
        learnt them (the step's time in the latency record); decoding_since: for a decode step's tokens, when the
        run of decode steps it belongs to began (the time before it, admissions and prefills, is not the step's)."""
        if decoding_since is not None and self.step_times:
            self.decode_steps_s += now - max(self.step_times[-1], decoding_since)
        self.step_times.append(now)
        self._append(tokens, margins, eos)
        if self.finish_reason:
            self.finished = now

    def _append(self, tokens: list[int], margins: list[float], eos: frozenset[int]) -> None:
        for tok, m in zip(tokens, margins):
            self.output.append(tok)
            self.margins.append(m)
            if tok in eos:
                self.finish_reason = "stop"
                return
            if len(self.output) >= self.max_tokens:
                self.finish_reason = "length"
                return

    def result(self) -> RequestResult:
        return RequestResult(
            id=self.req.id, category=self.req.category,
            prompt_token_ids=list(self.req.prompt_token_ids), output_token_ids=list(self.output),
            **self.counts.padded(self.K).result_fields(), finish_reason=self.finish_reason or "length",
            draft_steps=self.draft_steps, top2_margins=self.margins,
            latency=measured_latency(self.arrival, self.step_times, self.finished or self.step_times[-1],
                                     len(self.output), self.admitted, self.decode_steps_s),
        )
