"""The embedded runtime as a `qual run` engine."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

from pydantic import NonNegativeInt, PositiveInt, field_validator

import qual
from qual.checkpoints.config import max_positions, read_config
from qual.engines.base import KNOBS, Engine
from qual.errors import EngineError, QualError
from qual.options import DEFAULT_DCP_COMM, DEFAULT_DSA_TOPK, DEFAULT_NUMERICS, DcpComm
from qual.provenance import local_host, qual_commit
from qual.records import ArmConfig, ArmRunInfo, DoctorCheck, EngineBuild, EngineRequest, GraphCapture, OnResult
from qual.runtime.backends import parse_backend, part_problems
from qual.runtime.config import (DEFAULT_SIZES, CacheConfig, EngineConfig, ParallelConfig, SamplingParams,
                                 hang_dump_seconds)
from qual.validation import Section, parse_section


def _runtime():
    """qual.runtime.engine, imported by the methods that validate or run an arm (torch, ~2 s to import on 2 cores),
    so that a `qual` command refused on its options or files answers before torch loads. SIGINT and SIGTERM are
    held meanwhile: a Ctrl-C or a CI job's SIGTERM during torch's import is answered right after it
    (qual.proc.signals_held says why not during it)."""
    from qual.proc import signals_held
    from qual.stop_signals import STOP_SIGNALS

    try:
        with signals_held(set(STOP_SIGNALS)):
            import qual.runtime.engine as engine
    except (ImportError, OSError, MemoryError) as exc:  # a memory limit (ulimit -v), a broken torch install
        raise EngineError(f"the embedded runtime could not load torch: {type(exc).__name__}: {exc} (is a memory "
                          f"limit such as `ulimit -v` below what torch needs, or its install broken?)") from None
    return engine


_ENGINE, _CACHE = EngineConfig.__dataclass_fields__, CacheConfig.__dataclass_fields__  # the defaults, defined once
PHASE_TIMES_ENV = "QUAL_PHASE_TIMES"  # 1: record rank 0's host time by phase in arms.<arm>.extra.phase_times


def phase_times_on() -> bool:
    """Whether QUAL_PHASE_TIMES asks for phase times (a diagnostic: it changes nothing an arm computes)."""
    value = os.environ.get(PHASE_TIMES_ENV, "")
    if value not in ("", "0", "1"):
        raise QualError(f"{PHASE_TIMES_ENV}={value[:80]!r}: expected 1 (on), or 0 or unset (off)")
    return value == "1"


class ReferenceOptions(Section):
    """A profile's `reference:` section: how the embedded runtime runs the model."""

    block_size: PositiveInt = _CACHE["block_size"].default
    """Tokens a KV block holds on one rank"""
    kv_memory_mib: PositiveInt = _CACHE["memory_bytes"].default // 2**20
    """The KV cache's budget a rank, in MiB"""
    max_num_seqs: PositiveInt = _ENGINE["max_num_seqs"].default
    """Requests decoding together (the batch's rows)"""
    max_prefill_tokens: PositiveInt = _ENGINE["max_prefill_tokens"].default
    """Padded prompt tokens a prefill chunk holds (and admitted a step)"""
    cuda_graph_sizes: list[PositiveInt] | None = None
    """Batch sizes captured as CUDA graphs on cuda; unset: 1, 2, 4, 8, 16, 32, 64"""
    backend: str = _ENGINE["backend"].default
    """The kernels: pytorch, or parts joined by + (compiled, triton-gemm, triton-attention, fused, pdl, ...;
    docs/ARCHITECTURE.md, "Backends")"""
    dcp_comm: DcpComm = DEFAULT_DCP_COMM
    """How DCP ranks merge their partial attention: a2a (one all-to-all), ag_rs (all-gather of the LSEs,
    reduce-scatter) or invariant (DCP 1's bits at every DCP size; DCP 1, 2, 4 or 8: docs/dcp.md)"""
    steps_per_launch: PositiveInt = _ENGINE["steps_per_launch"].default
    """Decode steps a launch runs back to back where async decode is taken"""
    prefill_ahead: NonNegativeInt = _ENGINE["prefill_ahead"].default
    """Waiting requests prefilled beside a freed row's and held ready for the next rows (0: off; leave it off for
    latency or --speedup runs)"""

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        try:
            parse_backend(name)  # refused when the profile loads, not when the arm starts
        except QualError as exc:
            raise ValueError(str(exc)) from None
        return name


def engine_config(arm: ArmConfig) -> EngineConfig:
    """Arm -> runtime config; the profile's `reference:` section arrives in arm.extra["reference"]."""
    o = ReferenceOptions(**arm.extra.get("reference") or {})
    sizes = o.cuda_graph_sizes if o.cuda_graph_sizes is not None else DEFAULT_SIZES
    return EngineConfig(
        target_path=arm.target_path,
        draft_path=arm.draft_path,
        parallel=ParallelConfig(arm.tp, arm.dcp, arm.interleave, o.dcp_comm),
        cache=CacheConfig(block_size=o.block_size, memory_bytes=o.kv_memory_mib * 2**20),
        draft_kv=arm.draft_kv,
        num_speculative_tokens=arm.num_speculative_tokens if arm.draft_path else None,  # None: the drafter's block
        dtype=arm.dtype,
        device=arm.device,
        max_model_len=arm.extra.get("max_model_len", _ENGINE["max_model_len"].default),
        max_num_seqs=o.max_num_seqs,
        cuda_graph_sizes=tuple(sizes) if arm.device.startswith("cuda") else None,
        max_prefill_tokens=o.max_prefill_tokens,
        backend=o.backend,
        steps_per_launch=o.steps_per_launch,
        prefill_ahead=o.prefill_ahead,
        dsa_topk=arm.dsa_topk or DEFAULT_DSA_TOPK,
        numerics=arm.numerics or DEFAULT_NUMERICS,
        phase_times=phase_times_on(),
    )


def _with_target_modes(arm: ArmConfig, target, requested: frozenset[str]) -> ArmConfig:
    """The arm with the modes that run: the asked or default top-k where the target has sparse attention and the
    asked or default numerics where it models vLLM's, None where it has no such choice (asking for one there is
    refused: --dsa-topk when asked on the command line, numerics from the command line or the profile)."""
    model = target.model_class
    if "dsa_topk" in requested and not model.sparse_attention:
        raise QualError(f"--dsa-topk {arm.dsa_topk}: the target ({arm.target_path}) has no sparse attention")
    if arm.numerics is not None and not model.vllm_numerics:
        raise QualError(f"numerics {arm.numerics}: the target ({arm.target_path}) computes one way only (vLLM's "
                        "numerics are modelled for GLM-5 targets); remove --numerics or the profile's numerics:")
    return replace(arm, dsa_topk=(arm.dsa_topk or DEFAULT_DSA_TOPK) if model.sparse_attention else None,
                   numerics=(arm.numerics or DEFAULT_NUMERICS) if model.vllm_numerics else None)


class ReferenceEngine(Engine):
    """Runs one arm on the embedded DCP-aware DFlash runtime."""

    name = "reference"
    options_model = ReferenceOptions
    honours = frozenset(KNOBS)
    local_checkpoints = True
    version_label = f"qual-reference {qual.__version__}"

    @classmethod
    def parse_options(cls, section: dict, where: str) -> dict:
        return parse_section(ReferenceOptions, section, where, "reference").model_dump()

    @classmethod
    def doctor(cls) -> list[DoctorCheck]:
        """Which parts of the runtime's kernel backends (qual/runtime/backends) run here. Always yes: the pytorch
        backend runs anywhere; the parts that do not run here are named, with why as the evidence."""
        import torch

        problems = part_problems("cuda" if torch.cuda.is_available() else "cpu")
        runs = [p for p, why in problems.items() if why is None]
        not_here = [p for p, why in problems.items() if why]
        detail = f"pytorch and {', '.join(runs)}" if runs else "pytorch only"
        if not_here:
            detail += f"; not here: {', '.join(not_here)}"
        return [DoctorCheck("runtime backends", "yes", detail, [f"{p}: {problems[p]}" for p in not_here])]

    def version(self, arm: ArmConfig) -> str:
        return self.version_label

    def preflight(self, arm: ArmConfig, requested: frozenset[str]) -> ArmConfig:
        hang_dump_seconds()  # read by every rank as it starts: a bad value is refused before the first one
        if arm.tp > 1:  # a real run follows: its CPU rank server starts now, importing while this process does
            from qual.runtime.launch import rank_context

            rank_context(arm.device)
        target, _ = _runtime().validate(engine_config(arm))  # head layout vs tp/dcp, checkpoints readable, GPUs present
        return _with_target_modes(arm, target, requested)

    def dry_check(self, arm: ArmConfig, requested: frozenset[str]) -> ArmConfig:
        """preflight's checks of the checkpoints and options, where the target is on this machine; not the GPUs (a
        dry run may plan a GPU run from a machine without one) and nothing started."""
        hang_dump_seconds()  # the environment the run would start its ranks with
        if not (Path(arm.target_path) / "config.json").is_file():
            return arm  # the real run reports it missing
        target, _ = _runtime().validate(engine_config(arm), devices=False)
        return _with_target_modes(arm, target, requested)


    def notes(self, arm: ArmConfig) -> list[str]:
        """The target's config defaults that this arm's numerics compute otherwise than vLLM does (or the other way)."""
        if not (Path(arm.target_path) / "config.json").is_file():
            return []  # a dry run planned elsewhere: the real run reads it
        target = _runtime().target_spec(arm.target_path)
        return target.model_class.notes(target.config, arm.numerics or DEFAULT_NUMERICS)

    def context_needed(self, arm: ArmConfig, prompt_tokens: int, max_tokens: int) -> int:
        # The runtime reserves one verify step (the last token plus K drafts) beyond max_tokens.
        k = arm.num_speculative_tokens if arm.draft_path else 0
        return prompt_tokens + max_tokens + k + 1

    def describe(self, arm: ArmConfig) -> str:
        c = arm.to_json()
        c.pop("extra")
        return json.dumps(c)

    def generate(self, arm: ArmConfig, requests: list[EngineRequest]) -> list[dict]:
        """`qual generate`: the requests through the runtime as they are (no journal, no result), one dict per
        request in input order; the arm comes through preflight first, as a run's does."""
        runtime = _runtime()
        self._check_prompts(arm, requests, runtime.validate(engine_config(arm))[0].config.vocab_size)
        sampling = SamplingParams(temperature=arm.sampling.temperature, seed=arm.sampling.seed,
                                  max_tokens=arm.sampling.max_tokens)
        gen = [runtime.GenerationRequest(r.id, tuple(r.prompt_token_ids), r.max_tokens, r.category) for r in requests]
        with runtime.LLMEngine(engine_config(arm)) as engine:
            results = engine.generate(gen, sampling)
        return [{"id": r.id, "prompt_token_ids": r.prompt_token_ids, "output_token_ids": r.output_token_ids}
                for r in results]

    def _check_prompts(self, arm: ArmConfig, requests: list[EngineRequest], vocab: int) -> None:
        """Token ids given as they are (`qual generate`) are in the target's vocabulary, and each request fits the
        positions the target was built for: an id past the embedding table was an internal error, and a prompt past
        max_position_embeddings decoded silently (a run's tokenizer and plan see to both)."""
        limit = max_positions(read_config(arm.target_path))
        for r in requests:
            if (top := max(r.prompt_token_ids)) >= vocab:
                raise QualError(f"request {r.id!r}: token id {top} is not in the target's vocabulary ({vocab} ids)")
            needed = self.context_needed(arm, len(r.prompt_token_ids), r.max_tokens)
            if limit is not None and needed > limit:
                raise QualError(f"request {r.id!r}: prompt {len(r.prompt_token_ids)} tokens + max_tokens "
                                f"{r.max_tokens} needs {needed} positions, more than the target was built for "
                                f"(max_position_embeddings {limit} in {Path(arm.target_path) / 'config.json'})")

    def run(self, arm: ArmConfig, requests: list[EngineRequest], on_result: OnResult, run_dir: Path,
            name: str) -> ArmRunInfo:
        runtime = _runtime()
        GenerationRequest, LLMEngine = runtime.GenerationRequest, runtime.LLMEngine
        cfg = engine_config(arm)
        sampling = SamplingParams(temperature=arm.sampling.temperature, seed=arm.sampling.seed, max_tokens=arm.sampling.max_tokens)
        gen = [GenerationRequest(r.id, tuple(r.prompt_token_ids), r.max_tokens, r.category) for r in requests]
        start = time.perf_counter()
        with LLMEngine(cfg) as engine:
            ready = time.perf_counter()
            results = engine.generate(gen, sampling, on_result) if gen else []
            generating = time.perf_counter() - ready
            memory = engine.memory()
            graphs = engine.graph_capture()
            model = engine.model_facts()
            phases = engine.phase_times()
            decode = engine.decode_record()
        wall = time.perf_counter() - start
        return ArmRunInfo(
            engine_version=self.version_label,
            graph_capture=GraphCapture(**{k: v for k, v in graphs.items() if k in GraphCapture.__dataclass_fields__}),
            wall_seconds=wall,
            generate_seconds=generating,
            output_tokens=sum(len(r.output_token_ids) for r in results),
            extra={"kv_memory": memory, "graph_replays": graphs.get("replays"), "graph_eager_steps": graphs.get("eager_steps"),
                   "model": model, "decode": decode, **({"phase_times": phases} if phases else {})},
            build=EngineBuild(name=self.name, version=qual.__version__, commit=qual_commit()[0], host=local_host(),
                              runtime_config=asdict(cfg), source="this process (qual's embedded runtime)"),
        )
