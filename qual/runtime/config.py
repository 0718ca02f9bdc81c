"""Runtime configuration, validated on construction: a bad config never reaches a process."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from qual.errors import QualError
from qual.options import (DCP_COMM_MODES, DEFAULT_DCP_COMM, DEFAULT_DEVICE, DEFAULT_DRAFT_KV, DEFAULT_DSA_TOPK,
                          DEFAULT_DTYPE, DEFAULT_NUMERICS, DRAFT_KV_MODES, DSA_TOPK_MODES, DTYPES, INVARIANT, NUMERICS,
                          check_choice, check_device, check_layout, check_temperature)
from qual.runtime.backends import ATTENTION_PARTS, PYTORCH, parse_backend

# Batch sizes captured as CUDA graphs by default (qual/runtime/cuda_graphs.py); a step pads to the next one.
DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)

# Virtual shards of the invariant merge (dcp_comm invariant, qual/runtime/dcp_invariant.py): position p belongs to
# shard (p // interleave) % DCP_VIRTUAL_SHARDS, whatever the DCP size; the DCP sizes it runs are its divisors.
DCP_VIRTUAL_SHARDS = 8

HANG_DUMP_ENV = "QUAL_HANG_DUMP_S"
HANG_DUMP_MAX_S = 86400.0  # a day: longer than any step, and far inside what faulthandler's timer can hold


def hang_dump_seconds(environ=os.environ) -> float | None:
    """$QUAL_HANG_DUMP_S: every how many seconds each process of an engine prints its threads' stacks (where did a
    rank hang?); None where unset. Read by every rank (parallel.arm_hang_dump) and checked by the engine's preflight,
    so that a typo is one line before any process starts, not a rank's traceback."""
    value = environ.get(HANG_DUMP_ENV, "")
    if value == "":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= HANG_DUMP_MAX_S:  # NaN fails it too
        raise QualError(f"{HANG_DUMP_ENV}={value[:80]!r}: expected a number of seconds > 0 and at most "
                        f"{HANG_DUMP_MAX_S:.0f}, or unset (off)")
    return seconds


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """tp ranks form one tensor-parallel group; consecutive runs of dcp ranks form DCP groups."""

    tp: int = 1
    dcp: int = 1
    interleave: int = 1
    dcp_comm: str = DEFAULT_DCP_COMM  # merge of partial attention (qual.options.DCP_COMM_MODES)

    def __post_init__(self):
        check_choice("dcp_comm", self.dcp_comm, DCP_COMM_MODES)
        check_layout(self.tp, self.dcp, self.interleave)
        if self.invariant and DCP_VIRTUAL_SHARDS % self.dcp:
            raise QualError(f"dcp_comm {INVARIANT}: dcp={self.dcp} must divide the {DCP_VIRTUAL_SHARDS} virtual shards "
                            f"(dcp 1, 2, 4 or 8), so that each rank holds whole shards")

    @property
    def invariant(self) -> bool:
        """Whether DCP N computes DCP 1's bits (dcp_comm invariant): the merge, and admission (admission_dcp)."""
        return self.dcp_comm == INVARIANT

    @property
    def admission_dcp(self) -> int:
        """The DCP size the scheduler reckons a request's blocks at when it admits: 1 under the invariant merge, so that
        DCP N admits the same requests into the same steps as DCP 1 (a batch's shape decides how its GEMMs round),
        else the DCP size."""
        return 1 if self.invariant else self.dcp

    @property
    def world_size(self) -> int:
        return self.tp

    def check_model(self, num_attention_heads: int, num_kv_heads: int, what: str = "target") -> None:
        """The head layout must split across TP and give every DCP rank the KV heads of its gathered queries."""
        if num_attention_heads % self.tp:
            raise QualError(f"{what}: num_attention_heads={num_attention_heads} is not divisible by tp={self.tp}")
        if num_kv_heads % self.tp and self.tp % num_kv_heads:
            raise QualError(f"{what}: num_key_value_heads={num_kv_heads} and tp={self.tp} must divide one another")
        max_dcp = max(1, self.tp // num_kv_heads)
        if self.dcp > max_dcp:
            raise QualError(
                f"constraint dcp <= tp // num_kv_heads violated: dcp={self.dcp} > {self.tp} // {num_kv_heads} "
                f"(each DCP rank must hold the KV heads of all query heads gathered to it)"
            )

    def check_block_size(self, block_size: int) -> None:
        if block_size < self.interleave or block_size % self.interleave:
            raise QualError(
                f"constraint block_size >= interleave and block_size % interleave == 0 violated: "
                f"block_size={block_size}, interleave={self.interleave}"
            )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: B tokens per physical block; the pool is sized from a per-rank byte budget."""

    block_size: int = 16
    memory_bytes: int = 256 * 2**20
    draft_window: int | None = None  # bounds full-attention draft context too (None: unbounded)

    def __post_init__(self):
        if self.block_size < 1:
            raise QualError(f"block_size must be >= 1 (got {self.block_size})")
        if self.memory_bytes <= 0:
            raise QualError(f"KV memory budget must be positive (got {self.memory_bytes})")
        if self.draft_window is not None and self.draft_window < 1:
            raise QualError(f"draft_window must be >= 1 (got {self.draft_window})")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine instance: target (+ optional drafter) under a parallel layout."""

    target_path: str
    draft_path: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    draft_kv: str = DEFAULT_DRAFT_KV
    num_speculative_tokens: int | None = None  # None: drafter block_size - 1
    dtype: str = DEFAULT_DTYPE
    device: str = DEFAULT_DEVICE
    max_num_seqs: int = 64
    max_prefill_tokens: int = 8192  # padded tokens per prefill chunk (and admitted per step)
    max_model_len: int = 2048
    dist_timeout_s: float = 300.0
    threads_per_rank: int | None = None  # CPU: torch threads per rank (None: cores // world)
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode batch sizes to capture (CUDA only)
    static_shapes: bool = False  # run decode with the graphs' padded static shapes, eagerly (tests the graph path on CPU)
    backend: str = PYTORCH  # kernel backend by name (qual/runtime/backends): PyTorch operators only
    dsa_topk: str = DEFAULT_DSA_TOPK  # sparse-attention top-k under DCP, for targets that have it (qual.options)
    numerics: str = DEFAULT_NUMERICS  # how a target that models vLLM's numerics computes (qual.options.NUMERICS)
    phase_times: bool = False  # rank 0 times the host phases of generate (LLMEngine.phase_times); off: no-op laps
    # Greedy decode steps of an unchanged batch are launched before the last one's results are read, the device
    # advancing the step's inputs itself (docs/ARCHITECTURE.md). Taken where decode runs at static shapes on one
    # rank (CUDA graphs, or static_shapes); elsewhere every step waits for the one before (LLMEngine.async_decode).
    async_decode: bool = True
    # Decode steps a launch runs back to back (one CUDA graph of that many steps), read in one copy: the host's
    # per-launch work (schedule, inputs, launch) is paid once for them. Taken with async decode only (the device
    # advances each step's inputs); a run stops at the steps the batch is expected to need (scheduler.steps_to_launch), a
    # request that finishes inside it is read as finished and its later rows are dropped. 1: a step a launch.
    steps_per_launch: int = 1
    # Prefill chunks of up to this many padded tokens (prompts x longest prompt, each rounded up: prefill_graphs.bucket)
    # run at padded shapes, replayed from CUDA graphs where decode graphs are captured (qual/runtime/prefill_graphs.py);
    # 0: every prefill runs eagerly.
    prefill_graph_tokens: int = 4096
    # Waiting requests prefilled beyond the free rows (up to this many, a batch's worth in one prefill) and held ready
    # (KV and first token) until a row frees: when requests finish a few at a time (speculative decoding's uneven
    # lengths), each freed row then takes a held request without a prefill launch of its own, inside a run of launches
    # ahead (qual/runtime/decode_runs.py), where prefilling one or eight costs about the same on a GPU (a launch-bound
    # prefill graph). Refilled once none is held. 0: a freed row's request is prefilled when the row frees. Off by
    # default: a held request's wait for a row counts as decode time in its latency record.
    prefill_ahead: int = 0

    def __post_init__(self):
        check_choice("draft_kv", self.draft_kv, DRAFT_KV_MODES)
        check_choice("dtype", self.dtype, DTYPES)
        check_device("device", self.device)
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise QualError(f"num_speculative_tokens must be >= 1 (got {self.num_speculative_tokens})")
        if self.max_num_seqs < 1 or self.max_model_len < 2:
            raise QualError("max_num_seqs must be >= 1 and max_model_len >= 2")
        self.parallel.check_block_size(self.cache.block_size)
        backend = parse_backend(self.backend)
        backend.check(self.device, self.dtype, self.parallel.tp)
        if self.parallel.invariant:
            self._check_invariant_backend(backend)
        padded_prefill = self.static_shapes or (self.device == "cuda" and bool(self.cuda_graph_sizes))
        if backend.compile_prefill and not (padded_prefill and self.prefill_graph_tokens):
            raise QualError(f"backend {self.backend}: compiled-prefill compiles the prefill at padded shapes, which runs "
                            "with CUDA graphs (cuda_graph_sizes) or static_shapes and prefill_graph_tokens > 0")
        check_choice("dsa_topk", self.dsa_topk, DSA_TOPK_MODES)
        check_choice("numerics", self.numerics, NUMERICS)
        if self.steps_per_launch < 1:
            raise QualError(f"steps_per_launch must be >= 1 (got {self.steps_per_launch})")
        if self.prefill_ahead < 0:
            raise QualError(f"prefill_ahead must be >= 0 (got {self.prefill_ahead})")
        if self.prefill_graph_tokens < 0:
            raise QualError(f"prefill_graph_tokens must be >= 0 (got {self.prefill_graph_tokens})")
        if self.cuda_graph_sizes is not None and any(b < 1 for b in self.cuda_graph_sizes):
            raise QualError(f"cuda_graph_sizes must be positive batch sizes (got {self.cuda_graph_sizes})")

    def _check_invariant_backend(self, backend) -> None:
        """The invariant merge's bits rest on PyTorch's operators each rounding on its own (qual/runtime/dcp_invariant.py):
        a backend part that computes the attention its own way, or compiles the step (a compiler may fuse a multiply
        and an add into one rounding, as the shapes it sees lead it to), would break them, so it is refused by name."""
        replaced = [p for p in backend.parts if p in ATTENTION_PARTS]
        if replaced:
            raise QualError(f"backend {self.backend}: dcp_comm {INVARIANT} computes the target's attention itself (in "
                            f"a fixed summation order), which {' and '.join(replaced)} would take over: use another "
                            "dcp_comm, or a backend without them")
        if backend.compiles:
            raise QualError(f"backend {self.backend}: dcp_comm {INVARIANT} rests on every operator rounding on its own, "
                            "and a compiled step may fuse them (a multiply-add rounded once) differently at each DCP "
                            "size: use another dcp_comm, or a backend without compiled parts")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Greedy at temperature 0; otherwise sampling from the target with noise seeded per (seed, request, position)."""

    temperature: float = 0.0
    seed: int = 0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self):
        check_temperature("temperature", self.temperature)
        if self.max_tokens < 1:
            raise QualError(f"max_tokens must be >= 1 (got {self.max_tokens})")
