"""The embedded runtime as a `qual run` engine."""

from __future__ import annotations

import time

import qual
from qual.engines.base import ArmConfig, ArmRunInfo, EngineRequest, GraphCapture, OnResult
from qual.runtime.cuda_graphs import DEFAULT_SIZES
from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine


def engine_config(arm: ArmConfig) -> EngineConfig:
    """Arm -> runtime config; profile knobs arrive in arm.extra."""
    x = arm.extra
    knobs = x.get("reference") or {}
    return EngineConfig(
        target_path=arm.target_path,
        draft_path=arm.draft_path,
        parallel=ParallelConfig(arm.tp, arm.dcp, arm.interleave),
        cache=CacheConfig(block_size=x.get("block_size", 16), memory_bytes=x.get("kv_memory_mib", 256) * 2**20),
        draft_kv=arm.draft_kv,
        num_speculative_tokens=arm.num_speculative_tokens if arm.draft_path else None,
        dtype=arm.dtype,
        device=arm.device,
        max_model_len=x.get("max_model_len", 2048),
        max_num_seqs=knobs.get("max_num_seqs", 64),
        cuda_graph_sizes=tuple(knobs.get("cuda_graph_sizes", DEFAULT_SIZES)) if arm.device.startswith("cuda") else None,
        max_prefill_tokens=knobs.get("max_prefill_tokens", 8192),
        compile_mode=knobs.get("compile_mode"),
        triton_gemm=bool(knobs.get("triton_gemm", False)),
        triton_attention=bool(knobs.get("triton_attention", False)),
        fused_decode=bool(knobs.get("fused_decode", False)),
    )


class ReferenceEngine:
    """Runs one arm on the embedded DCP-aware DFlash runtime."""

    version = f"qual-reference {qual.__version__}"

    def run(self, arm: ArmConfig, requests: list[EngineRequest], on_result: OnResult) -> ArmRunInfo:
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
        wall = time.perf_counter() - start
        return ArmRunInfo(
            engine_version=self.version,
            graph_capture=GraphCapture(**{k: v for k, v in graphs.items() if k in GraphCapture.__dataclass_fields__}),
            wall_seconds=wall,
            generate_seconds=generating,
            output_tokens=sum(len(r.output_token_ids) for r in results),
            extra={"kv_memory": memory, "graph_replays": graphs.get("replays"), "graph_eager_steps": graphs.get("eager_steps")},
        )
