"""Records shared by the layers: one arm's config in, per-request results and run facts out.

Neutral ground: engines, the harness, stats, results and reports all import these; this module imports nothing
of qual but the error type.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Sampling:
    """Sampling shared by both arms: temperature 0 is greedy."""

    temperature: float = 0.0
    seed: int = 0
    max_tokens: int = 128


@dataclass(frozen=True)
class ArmConfig:
    """Everything that defines one arm; serialised as result.json arms.<arm>.config."""

    engine: str
    model: str
    dcp: int
    tp: int
    draft_kv: str
    target_path: str
    draft_path: str | None
    num_speculative_tokens: int
    sampling: Sampling
    interleave: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    extra: dict = field(default_factory=dict)  # engine-specific knobs from the model profile

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EngineRequest:
    """A corpus request after tokenization: both arms receive identical token ids."""

    id: str
    category: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass
class RequestResult:
    """One request's outcome in one arm (a line of result.json per_request)."""

    id: str
    category: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    finish_reason: str = "length"
    # (number of committed tokens when the draft was made, proposed tokens):
    # lets the comparison find draft steps taken at identical context.
    draft_steps: list[list] = field(default_factory=list)
    # Target top-1 minus top-2 logit per output token, where the engine can say (near-tie analysis).
    top2_margins: list[float] | None = None
    # Where drafts/accepted counts came from, where the engine had a choice: "per_request_metrics" (the server's reply)
    # or "metrics_diff" (/metrics counters before and after, one request at a time); None: the engine counted itself.
    acceptance_source: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "RequestResult":
        return cls(**data)


@dataclass
class GraphCapture:
    """CUDA-graph capture record of one arm."""

    status: str = "unsupported"  # captured | failed | unsupported | not_observed (GRAPH_NOT_OBSERVED)
    mode: str | None = None
    sizes: list[int] = field(default_factory=list)
    seconds: float | None = None
    bytes: int | None = None
    eager_fallback_sizes: list[int] = field(default_factory=list)
    detail: str | None = None
    backend: dict | None = None  # the engine's kernel backend and the steps each part serves, where it says


# An attached server's start-up (where vLLM captures its graphs) happened before qual saw it: its capture is not
# observed, neither captured nor unsupported. The gate's graph check skips such an arm rather than guess.
GRAPH_NOT_OBSERVED = "not_observed"


@dataclass
class HostFacts:
    """The machine a process ran on, as far as it can tell (None where it cannot)."""

    hostname: str | None = None
    platform: str | None = None
    python: str | None = None
    torch: str | None = None
    cuda: str | None = None  # the CUDA runtime torch was built with (None on a CPU build)
    gpus: list[str] = field(default_factory=list)  # device names, one per visible GPU
    gpu_driver: str | None = None
    cpu_model: str | None = None
    source: str = "this process"  # how these facts were learned (e.g. "this process", "/server_info")


@dataclass
class EngineBuild:
    """Which engine build ran an arm, where, and with what command or configuration."""

    name: str  # the engine: reference | vllm | attach
    version: str | None = None
    commit: str | None = None  # None where the build does not record one
    host: HostFacts | None = None  # where the engine ran; None where nothing says (an attached server without /server_info)
    server_command: str | None = None  # the exact server command (a server qual launched)
    runtime_config: dict | None = None  # the configuration the engine ran with, as the engine states it
    reported: dict = field(default_factory=dict)  # what a server said about itself (parallel, speculative, ...)
    source: str = ""  # where these facts came from

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
    """One line of `qual doctor`: a verdict (yes/no/unknown) with what it rests on."""

    name: str
    verdict: str
    detail: str
    evidence: list[str] = field(default_factory=list)
    install: str | None = None  # which install the check is about (the label of its engine's first line)
