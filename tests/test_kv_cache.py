"""Block pool, admission, sliding-window release and per-rank KV memory."""

import pytest

from qual.errors import QualError
from qual.options import REPLICATED, SHARDED
from qual.runtime.kv_cache import BlockPool, CacheManager, KVCacheGroup, KVCacheSpec


def spec(sharded=True, window=None, attention="full"):
    return KVCacheSpec("gqa", SHARDED if sharded else REPLICATED, 4, num_kv_heads=1, head_dim=16, window=window,
                       attention=attention)


def manager(dcp, groups, memory=2**24, block_size=16, lookahead=8):
    return CacheManager(groups, block_size, dcp, memory, lookahead)


def test_pool_allocates_and_frees():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free == 1
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.free(ids)
    assert pool.num_free == 4


def test_mixed_replication_never_merges():
    a = KVCacheGroup("target", spec(sharded=True), ("t.0",))
    b = KVCacheGroup("draft", spec(sharded=False), ("d.0",))
    with pytest.raises(QualError, match="different replication"):
        a.merge(b)
    merged = a.merge(KVCacheGroup("t2", spec(sharded=True), ("t.1",)))
    assert merged.layers == ("t.0", "t.1")


def test_target_kv_per_rank_at_dcp4_is_a_quarter():
    prompt = 8000
    used = {}
    for dcp in (1, 4):
        m = manager(dcp, [KVCacheGroup("target", spec(), tuple(f"t.{i}" for i in range(6)))], memory=2**30)
        m.admit("r", prompt + 64)
        m.ensure("r", prompt)
        used[dcp] = m.memory()["target"]["used_bytes"]
    assert used[4] <= 0.26 * used[1]


def test_replicated_draft_group_is_bounded_by_its_window():
    window = 256
    for prompt in (1000, 8000):
        g = KVCacheGroup("draft", spec(sharded=False, window=window), ("d.0",))
        m = manager(4, [g], memory=2**30)
        m.admit("r", prompt + 64)
        for ctx in range(0, prompt, 100):  # context grows; blocks behind the window are released
            m.ensure("r", ctx + 8)
            m.release_outside_window("draft", "r", ctx)
        blocks = m.memory()["draft"]["used_blocks"]
        assert blocks <= window // 16 + 2, (prompt, blocks)


def test_admission_refuses_what_does_not_fit_and_frees():
    g = KVCacheGroup("target", spec(), ("t.0",))
    bb = g.block_bytes(16)
    m = manager(1, [g], memory=bb * 10)
    assert m.num_blocks == 10
    assert m.can_admit(160) and not m.can_admit(161)
    m.admit("a", 100)  # reserves 7 blocks for its whole life
    assert not m.can_admit(64)  # 3 left, needs 4
    assert m.can_admit(48)
    m.free("a")
    assert m.can_admit(160)


def test_a_request_never_holds_more_than_it_reserved():
    """The engine admits each request with the tail its launches may write past the end (LLMEngine.tail); a block
    table that outgrows the reservation means that tail was short, and is refused where it happens."""
    g = KVCacheGroup("target", spec(), ("t.0",))
    m = manager(1, [g])
    m.admit("a", 100)  # 7 blocks of 16
    m.ensure("a", 112)
    with pytest.raises(RuntimeError, match="holds 8 blocks of target, reserved 7"):
        m.ensure("a", 113)


def test_every_group_must_fit():
    t = KVCacheGroup("target", spec(), ("t.0",))
    d = KVCacheGroup("draft", spec(sharded=False), ("d.0",))
    m = manager(4, [t, d], memory=(t.block_bytes(16) + d.block_bytes(16)) * 8)
    # at DCP4 the target needs 2 blocks for 128 tokens but the replicated draft group needs 8
    assert m.can_admit(128) and not m.can_admit(129)


@pytest.mark.parametrize("kind,pool", [("gqa", 1), ("latent", 1), ("pooled", 4), ("pooled", 128)])
def test_tokens_within_is_the_longest_sequence_whose_entries_fit(kind, pool):
    s = KVCacheSpec(kind, SHARDED, 2, num_kv_heads=1, head_dim=16, pool=pool)
    for entries in range(0, 300):
        n = s.tokens_within(entries)
        assert s.entries(n) <= entries < s.entries(n + 1), (entries, n)


def test_ensure_for_no_more_tokens_than_held_changes_nothing_and_a_readmitted_request_starts_over():
    """ensure() is asked for every row of every decode launch; once a request holds slots for n tokens, a call for n
    or fewer returns at once, and a request freed and admitted again under the same id gets its blocks anew."""
    full = KVCacheGroup("target", spec(), ("t.0",))
    windowed = KVCacheGroup("draft", spec(sharded=False, window=32), ("d.0",))
    m = manager(2, [full, windowed], memory=2**24)
    assert m.windowed == ("draft",)
    m.admit("a", 400)
    m.ensure("a", 200)
    held = {name: list(m.tables[name]["a"]) for name in m.groups}
    free = {name: pool.num_free for name, pool in m.pools.items()}
    m.release_outside_window("draft", "a", 200)  # blocks behind the window go; the table keeps its length
    for n in (1, 150, 200):
        m.ensure("a", n)
    assert m.tables["target"]["a"] == held["target"] and m.pools["target"].num_free == free["target"]
    assert len(m.tables["draft"]["a"]) == len(held["draft"])
    m.ensure("a", 208)  # the end of the draft's 13th block of 16 (the target's 7 blocks of 16 x 2 hold 224)
    assert len(m.tables["draft"]["a"]) == len(held["draft"]) and m.pools["target"].num_free == free["target"]
    m.ensure("a", 209)  # one past it: the draft's next block
    assert len(m.tables["draft"]["a"]) == len(held["draft"]) + 1 and len(m.tables["target"]["a"]) == len(held["target"])
    used = m.memory()["target"]["used_blocks"]
    m.ensure("a", 201 + 32)  # past what it holds: the next block of each group
    assert m.memory()["target"]["used_blocks"] == used + 1 and m.tables["target"]["a"] == held["target"]
    m.free("a")
    m.admit("a", 400)
    m.ensure("a", 20)  # 20 tokens: one block of 16 x DCP 2 (sharded), two of 16 (replicated)
    assert m.memory()["target"]["used_blocks"] == 1 and len(m.tables["draft"]["a"]) == 2


def test_a_group_without_a_window_takes_its_blocks_at_admission_and_records_those_holding_positions():
    """Admission gives a request its whole reservation in every group without a window (up to max_len tokens' worth:
    a decode step's static table), so its table does not change as it grows; the memory record still counts the
    blocks that hold positions, as when blocks were taken as the request grew. ensure() past max_len takes more."""
    full = KVCacheGroup("target", spec(), ("t.0",))
    m = manager(1, [full], memory=2**24)
    m.max_len = 160
    m.admit("a", 400)  # 25 blocks reserved, 10 taken (160 tokens)
    assert len(m.tables["target"]["a"]) == 10 and m.pools["target"].num_free == m.num_blocks - 10
    assert m.memory()["target"]["used_blocks"] == 0
    m.ensure("a", 33)
    assert m.memory()["target"]["used_blocks"] == 3 and m.memory()["target"]["peak_bytes"] == 3 * full.block_bytes(16)
    m.admit("b", 40)  # 3 blocks reserved and taken
    m.ensure("b", 40)
    assert m.memory()["target"]["used_blocks"] == 6 and len(m.tables["target"]["b"]) == 3
    m.free("b")
    assert m.memory()["target"]["used_blocks"] == 3 and m.memory()["target"]["peak_bytes"] == 6 * full.block_bytes(16)
    assert m.can_admit(16 * (m.num_blocks - 25)) and not m.can_admit(16 * (m.num_blocks - 25) + 1)  # 15 still owed to a
    m.ensure("a", 161)  # past max_len: one more block, now
    assert len(m.tables["target"]["a"]) == 11 and m.memory()["target"]["used_blocks"] == 11


def test_tables_changed_names_the_requests_whose_blocks_moved_since_the_last_send():
    """What a decode launch ahead asks before it leaves the tables on the device as they are: a new request's table,
    a windowed group's block taken or released, and a table grown past max_len count; ensure() inside a table
    taken at admission does not."""
    full = KVCacheGroup("target", spec(), ("t.0",))
    windowed = KVCacheGroup("draft", spec(sharded=False, window=32), ("d.0",))
    m = manager(1, [full, windowed], memory=2**24)
    m.admit("a", 200)
    m.admit("b", 200)
    assert m.tables_changed(["a"]) and m.tables_changed(["b"])
    m.ensure("a", 16)  # the draft's first block
    m.tables_sent()
    assert not m.tables_changed(["a", "b"])
    m.ensure("a", 16)
    m.ensure("b", 0)
    assert not m.tables_changed(["a", "b"])
    m.ensure("a", 17)  # the draft's next block; the target's was taken at admission
    assert m.tables_changed(["a"]) and not m.tables_changed(["b"])
    m.tables_sent()
    m.release_outside_window("draft", "a", 16 + 32 + 1)  # the draft's first block leaves the window
    assert m.tables_changed(["a", "b"]) and not m.tables_changed(["b"])
    m.free("a")
    assert not m.tables_changed(["a"])


def test_the_blocks_owed_are_every_reservation_less_the_blocks_held():
    """can_admit() weighs the free blocks against those reserved and not yet held, kept as tables change: after
    admissions, growth, windows sliding and frees in any order it equals the count taken over every table."""
    import random

    full = KVCacheGroup("target", spec(), ("t.0",))
    windowed = KVCacheGroup("draft", spec(sharded=False, window=24), ("d.0",))
    m = manager(2, [full, windowed], memory=2**22)
    m.max_len = 300
    rng = random.Random(0)
    lengths, totals = {}, {}
    for _ in range(400):
        op = rng.random()
        if op < 0.25 and m.can_admit(400):
            rid = f"r{rng.randrange(10**6)}"
            totals[rid] = rng.randrange(40, 400)
            m.admit(rid, totals[rid])
            lengths[rid] = 0
        elif op < 0.85 and lengths:
            rid = rng.choice(sorted(lengths))
            lengths[rid] = min(lengths[rid] + rng.randrange(1, 40), totals[rid])
            m.ensure(rid, lengths[rid])
            m.release_outside_window("draft", rid, lengths[rid])
        elif lengths:
            m.free(lengths.pop(rng.choice(sorted(lengths))))
        for name in m.groups:
            held = sum(sum(1 for b in t if b >= 0) for t in m.tables[name].values())
            assert m.owed[name] == sum(m.reserved[name].values()) - held
