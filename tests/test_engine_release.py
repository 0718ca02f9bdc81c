"""A closed engine's weights and KV caches go with its last reference, by reference counting alone: a run's second arm
starts in the same process at once, and on a GPU the first arm's memory must be free by then, not whenever the
cycle collector next makes a full pass."""

import gc
import weakref

import pytest

from qual.runtime.config import CacheConfig, EngineConfig, SamplingParams
from qual.runtime.engine import LLMEngine
from runtime_helpers import prompts


@pytest.mark.parametrize("static_shapes", [True, False])  # with the padded prefill's graphs object, and without
def test_a_closed_engine_is_freed_without_the_cycle_collector(tiny_pair, static_shapes):
    cfg = EngineConfig(str(tiny_pair[0]), str(tiny_pair[1]), cache=CacheConfig(block_size=4, memory_bytes=2**22),
                       dtype="float32", static_shapes=static_shapes, max_model_len=128)
    gc.collect()
    gc.disable()
    try:
        with LLMEngine(cfg) as engine:
            engine.generate(prompts(3), SamplingParams(max_tokens=6))
            assert (engine.runner.prefill_graphs is not None) == static_shapes
        parts = [weakref.ref(x) for x in (engine.runner, engine.runner.caches, engine.runner.target, engine.cache)]
        del engine
        assert [p() is None for p in parts] == [True] * len(parts)
    finally:
        gc.enable()
