"""The driver's decisions, as plain functions over plain data: which waiting requests to admit, and how far decode
launches may run ahead of the host's reads (async decode). None of them changes what a step computes, only when
it is launched; tests/test_scheduler.py checks them without processes."""

from __future__ import annotations

from collections import deque

from qual.runtime.kv_cache import CacheManager
from qual.runtime.sequence import Sequence


def admit(waiting: deque[Sequence], running: int, cache: CacheManager, max_num_seqs: int, max_prefill_tokens: int,
          tail: int, ahead: int = 0) -> list[Sequence]:
    """Take requests off the front of `waiting` while the batch has room (max_num_seqs, and `ahead` more to be held
    ready for the rows that free up next: EngineConfig.prefill_ahead), the prefill's token budget holds them (the
    first one always goes) and the cache can hold each for its whole life plus `tail` positions past it (what
    launches ahead may write); each admitted request gets its prompt's blocks."""
    admitted, budget = [], max_prefill_tokens
    while waiting and running + len(admitted) < max_num_seqs + ahead:
        s = waiting[0]
        if (admitted and s.prompt_len > budget) or not cache.can_admit(s.reserved_len + tail):
            break
        waiting.popleft()
        cache.admit(s.req.id, s.reserved_len + tail)
        cache.ensure(s.req.id, s.prompt_len)
        admitted.append(s)
        budget -= s.prompt_len
    return admitted


def launches_ahead(batch_size: int, greedy: bool, can_launch_ahead: bool, waiting: bool, max_num_seqs: int) -> bool:
    """Whether decode steps of this batch may be launched before the last one's results are read: greedy choices (the
    device accepts by itself), a step shape that allows it (can_launch_ahead: static shapes), and a batch that cannot
    change before the next launch (nothing waits, or the batch is full)."""
    return greedy and can_launch_ahead and (not waiting or batch_size >= max_num_seqs)


def chains_prefill(batch_size: int, admitted: list[Sequence], greedy: bool, can_launch_ahead: bool, waiting: bool,
                   max_num_seqs: int) -> bool:
    """Whether the first decode step of a batch can go out right behind the prefill of `admitted`, before their first
    tokens are read (the device puts them in): when it could launch ahead at all, and each admitted request wants a
    second token."""
    return (launches_ahead(batch_size, greedy, can_launch_ahead, waiting, max_num_seqs)
            and all(s.max_tokens > 1 for s in admitted))


def reach(in_flight: int, steps: int, K: int) -> int:
    """Positions past the committed length (as the host last read it) that a launch of `steps` steps may write while
    `in_flight` steps launched before it are unread: each step commits at most K + 1 tokens and writes K past its own
    committed length."""
    return (in_flight + steps) * (K + 1) - 1


def fits_ahead(seqs: list[Sequence], in_flight: int, steps: int, K: int, max_model_len: int) -> bool:
    """Whether a launch before the last one is read fits: it writes up to reach() positions past each request's
    committed length, inside the request's reservation (admitted with that tail) and the static width of
    max_model_len."""
    far = reach(in_flight, steps, K)
    return all(s.num_committed + far <= max_model_len for s in seqs)


def steps_to_launch(seqs: list[Sequence], in_flight: int, tokens_per_step: float, max_steps: int,
                    unread: list[Sequence] = ()) -> int:
    """Steps the next launch runs, up to max_steps (0: none is expected to be needed, so none goes out before the last
    one is read): as many as the batch's longest request is expected to need after the `in_flight` steps launched
    before it, at `tokens_per_step` (the mean a verify step has committed; K + 1 before the first). unread: requests
    whose first token (a prefill's) is not read yet.

    Plain decoding commits one token a step, so launches stop at the last token a request needs; a speculative launch
    may run a step past it (read for nothing), or stop a step early (the next launch then waits for the last one's
    results, a pause of the host's commit and launch). A heuristic of speed only: what each step computes is the same.
    """
    need, pending = 0, {id(s) for s in unread}
    for s in seqs:
        left = s.reserved_len - s.num_committed - (id(s) in pending) - in_flight * tokens_per_step
        need = max(need, -int(-left // tokens_per_step))
    return min(max_steps, need)


class StepTally:
    """Verify steps run so far and the tokens they committed: the mean a step commits, for steps_to_launch."""

    def __init__(self, K: int):
        self.K, self.steps, self.tokens = K, 0, 0

    def add(self, accepted: int) -> None:
        self.steps += 1
        self.tokens += accepted + 1

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else self.K + 1
