"""The driver's heap is frozen while engines run (qual/runtime/heap.py): the cycle collector's full walks skip what
was alive at an engine's start, and the last engine to close hands those objects back to it."""

import gc

import pytest

from qual.errors import QualError
from qual.runtime.config import CacheConfig, EngineConfig
from qual.runtime.engine import LLMEngine


def config(tiny_pair, **over):
    return EngineConfig(str(tiny_pair[0]), str(tiny_pair[1]), cache=CacheConfig(block_size=4, memory_bytes=2**22),
                        dtype="float64", max_model_len=64, **over)


def test_an_engine_freezes_the_heap_it_starts_with_and_the_last_to_close_unfreezes_it(tiny_pair):
    from qual.runtime import heap

    assert heap._engines == 0 and gc.get_freeze_count() == 0, "an engine an earlier test started is still open"
    with LLMEngine(config(tiny_pair)):
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the engine's own objects among them
        # Not >= frozen: a frozen object whose last reference goes is freed all the same (a CI run saw one fewer).
        # Unfreezing would empty the count.
        with LLMEngine(config(tiny_pair)):
            assert gc.get_freeze_count() > frozen // 2
        assert gc.get_freeze_count() > frozen // 2  # the first engine still runs
    assert gc.get_freeze_count() == 0


def test_an_engine_that_fails_to_start_freezes_nothing(tiny_pair, monkeypatch):
    from qual.runtime import engine as engine_module

    def fail(self, specs):
        raise QualError("no start")

    monkeypatch.setattr(engine_module.LLMEngine, "_start", fail)
    with pytest.raises(QualError, match="no start"):
        LLMEngine(config(tiny_pair))
    assert gc.get_freeze_count() == 0
