"""The driver's scheduling decisions (qual/runtime/scheduler.py) on plain data: no process, no model."""

from collections import deque

from qual.options import SHARDED
from qual.runtime.kv_cache import CacheManager, KVCacheGroup, KVCacheSpec
from qual.runtime.scheduler import (StepTally, admit, chains_prefill, fits_ahead, launches_ahead, reach,
                                    steps_to_launch)
from qual.runtime.sequence import GenerationRequest, Sequence


def seq(name: str, prompt: int, max_tokens: int, K: int = 3, output: int = 0) -> Sequence:
    s = Sequence(GenerationRequest(name, tuple(range(1, prompt + 1))), max_tokens, K)
    s.output = [7] * output
    return s


def cache(blocks: int, block_size: int = 4, dcp: int = 1, admission_dcp: int | None = None) -> CacheManager:
    spec = KVCacheSpec("gqa", SHARDED, 2, num_kv_heads=1, head_dim=4)
    group = KVCacheGroup("target", spec, ("t.0",))
    return CacheManager([group], block_size, dcp, memory_bytes=blocks * group.block_bytes(block_size), lookahead=4,
                        admission_dcp=admission_dcp)


def test_admission_takes_the_front_while_seats_budget_and_cache_hold():
    waiting = deque([seq("a", 10, 6), seq("b", 10, 6), seq("c", 10, 6)])
    # 4 seats, a prefill budget of 15 tokens: the first always goes, the second would exceed the budget
    assert [s.req.id for s in admit(waiting, 0, cache(100), 4, 15, tail=4)] == ["a"]
    assert [s.req.id for s in admit(waiting, 1, cache(100), 2, 100, tail=4)] == ["b"]  # one seat left
    # a cache of 5 blocks of 4 holds one request of 10 + 6 + 4 positions, not two
    full = cache(5)
    assert [s.req.id for s in admit(deque([seq("x", 10, 6), seq("y", 10, 6)]), 0, full, 4, 100, tail=4)] == ["x"]
    # its whole reservation taken at admission, the prompt's blocks ensured (used)
    assert len(full.tables["target"]["x"]) == 5 and full.memory()["target"]["used_blocks"] == 3


def test_launching_ahead_needs_greedy_static_shapes_and_a_batch_that_cannot_change():
    assert launches_ahead(4, True, True, waiting=False, max_num_seqs=8)
    assert launches_ahead(8, True, True, waiting=True, max_num_seqs=8)  # full: nothing can join
    assert not launches_ahead(4, True, True, waiting=True, max_num_seqs=8)  # a request could join next step
    assert not launches_ahead(4, False, True, waiting=False, max_num_seqs=8)  # sampling reads choices on the host
    assert not launches_ahead(4, True, False, waiting=False, max_num_seqs=8)  # eager shapes
    one_token = [seq("a", 5, 1)]
    assert not chains_prefill(4, one_token, True, True, False, 8)  # its prefill's token is its last
    assert chains_prefill(4, [seq("a", 5, 2)], True, True, False, 8)


def test_reach_and_room():
    assert reach(0, 1, K=3) == 3  # one step writes K past the committed length
    assert reach(2, 2, K=3) == 15  # four steps, each committing at most K + 1
    s = seq("a", 10, 20, K=3, output=5)  # 15 committed
    assert fits_ahead([s], 1, 1, K=3, max_model_len=15 + 7)
    assert not fits_ahead([s], 1, 1, K=3, max_model_len=15 + 6)


def test_steps_to_launch_follow_the_longest_request_at_the_mean_a_step_commits():
    a, b = seq("a", 10, 8, output=2), seq("b", 10, 5, output=1)  # 6 and 4 tokens left
    assert steps_to_launch([a, b], 0, tokens_per_step=1.0, max_steps=16) == 6  # plain decoding: exact
    assert steps_to_launch([a, b], 2, tokens_per_step=1.0, max_steps=16) == 4  # two already in flight
    assert steps_to_launch([a, b], 0, tokens_per_step=1.0, max_steps=4) == 4  # capped
    assert steps_to_launch([a], 0, tokens_per_step=1.0, max_steps=16, unread=[a]) == 5  # its first token is coming
    assert steps_to_launch([a, b], 0, tokens_per_step=2.5, max_steps=16) == 3  # ceil(6 / 2.5)
    assert steps_to_launch([a, b], 6, tokens_per_step=1.0, max_steps=16) == 0  # nothing more is expected
    tally = StepTally(K=3)
    assert tally.tokens_per_step == 4  # K + 1 before the first verify step
    tally.add(0), tally.add(3)
    assert tally.tokens_per_step == (1 + 4) / 2


def test_a_sequence_counts_its_verify_steps_and_stops_at_eos_or_length():
    s = seq("a", 4, 5, K=3)
    assert s.record_verify([5, 6, 9], [5, 6, 7, 8]) == 2
    assert s.counts.accepted_per_position == [1, 1, 0] and s.draft_steps == [[4, [5, 6, 9]]]
    s.append([5, 6, 7], [1.0] * 3, eos=frozenset({99}))
    assert s.output == [5, 6, 7] and s.finish_reason is None
    s.append([99, 3], [1.0] * 2, eos=frozenset({99}))
    assert s.output == [5, 6, 7, 99] and s.finish_reason == "stop"
    t = seq("b", 4, 2)
    t.append([1, 2, 3], [0.0] * 3, eos=frozenset())
    assert t.output == [1, 2] and t.finish_reason == "length"


def _admissions(c: CacheManager, lengths: list[int], finish_after: int = 2) -> list[list[str]]:
    """The requests each step admits, 4 seats, every admitted request finishing `finish_after` steps later."""
    waiting = deque(seq(f"r{i}", n, 6) for i, n in enumerate(lengths))
    running: list[tuple[int, Sequence]] = []
    steps = []
    for step in range(3 * len(lengths)):
        for s in [s for t, s in running if step - t >= finish_after]:
            c.free(s.req.id)
        running = [(t, s) for t, s in running if step - t < finish_after]
        admitted = admit(waiting, len(running), c, 4, 1000, tail=4)
        running += [(step, s) for s in admitted]
        steps.append([s.req.id for s in admitted])
    return steps


def test_admission_at_dcp_1_makes_dcp_n_admit_what_dcp_1_does():
    """Under the invariant merge (ParallelConfig.admission_dcp == 1) a DCP 4 engine admits the same requests into the
    same steps as DCP 1 where memory binds; reckoned at its own DCP size it admits more at once (another batch)."""
    lengths = [30, 14, 40, 22, 9, 35, 18, 27]
    dcp1 = _admissions(cache(24), lengths)
    assert _admissions(cache(24, dcp=4, admission_dcp=1), lengths) == dcp1
    assert _admissions(cache(24, dcp=4), lengths) != dcp1
    assert max(len(a) for a in dcp1) < 4  # memory, not the seats, bound DCP 1 here
