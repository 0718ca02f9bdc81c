"""CUDA and NCCL: the same invariants on GPUs, plus CUDA graphs equal eager. Skipped without CUDA."""

import pytest
import torch

from runtime_helpers import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
GRAPHS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def cpu_control(tiny_pair):
    return run(*tiny_pair)[0]


def outputs(rs):
    return [r.output_token_ids for r in rs]


def test_cuda_matches_cpu_float64(tiny_pair, cpu_control):
    out, _ = run(*tiny_pair, device="cuda")
    assert outputs(out) == outputs(cpu_control)
    assert [r.draft_steps for r in out] == [r.draft_steps for r in cpu_control]


def test_cuda_graphs_equal_eager(tiny_pair, cpu_control):
    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import LLMEngine
    from runtime_helpers import prompts

    cfg = EngineConfig(str(tiny_pair[0]), str(tiny_pair[1]), ParallelConfig(1, 1, 1), CacheConfig(block_size=4, memory_bytes=2**22),
                       dtype="float64", device="cuda", cuda_graph_sizes=GRAPHS, max_model_len=256)
    with LLMEngine(cfg) as engine:
        out = engine.generate(prompts(), SamplingParams(seed=7, max_tokens=20))
        record = engine.graph_capture()
    assert outputs(out) == outputs(cpu_control)
    assert [r.draft_steps for r in out] == [r.draft_steps for r in cpu_control]
    assert record["status"] == "captured" and record["sizes"] == list(GRAPHS), record
    assert sum(record["replays"].values()) > 0 and record["eager_fallback_sizes"] == []


@two_gpus
def test_nccl_dcp2_matches_dcp1_with_graphs(tiny_pair, cpu_control):
    out, _ = run(*tiny_pair, tp=2, dcp=2, device="cuda", cuda_graph_sizes=GRAPHS, max_model_len=256)
    assert outputs(out) == outputs(cpu_control)
    assert [r.draft_steps for r in out] == [r.draft_steps for r in cpu_control]


@two_gpus
def test_nccl_dcp2_interleave2_and_sharded(tiny_pair, cpu_control):
    out, _ = run(*tiny_pair, tp=2, dcp=2, interleave=2, device="cuda")
    assert outputs(out) == outputs(cpu_control)
    legacy, _ = run(*tiny_pair, tp=2, dcp=2, draft_kv="sharded", device="cuda")
    assert outputs(legacy) == outputs(cpu_control)
    assert [r.draft_steps for r in legacy] != [r.draft_steps for r in cpu_control]
