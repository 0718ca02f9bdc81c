"""Paged KV cache bookkeeping: group specs, block pools, block tables, admission, memory accounting.

Lives on the driver (rank 0). Every rank holds the same block ids; the geometry of a
group (sharded under DCP or replicated) decides which tokens land in a rank's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qual.errors import QualError
from qual.options import DRAFT_KV_MODES, SHARDED, check_choice
from qual.runtime.geometry import blocks_needed


KINDS = ("gqa", "latent", "pooled", "ring", "state")
PER_REQUEST = ("ring", "state")  # kinds that hold a fixed amount per request: one block each, never sharded


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What one layer caches on one rank.

    kind: "gqa" = K and V per KV head per token; "latent" = one MLA latent vector per token (head_dim wide);
    "pooled" = one vector per `pool` consecutive tokens (DSA's pooled index keys; the pool is the unit of the DCP
    sharding); "ring" = the last `ring` tokens' vectors of a request (slot = position % ring); "state" = a
    fixed-size state per request (linear attention), no per-token cache.
    """

    kind: str
    # qual.options.DRAFT_KV_MODES, the two geometries of any group: "sharded" = DCP geometry (virtual block B*N);
    # "replicated" = DCP 1 geometry on every rank. A drafter's group takes the run's draft_kv as it is.
    replication: str
    dtype_bytes: int
    num_kv_heads: int = 0  # gqa: KV heads on one rank
    head_dim: int = 0  # gqa: per head; latent, pooled, ring: the vector width
    window: int | None = None  # context positions visible (None: all)
    attention: str = "full"  # "full": window (if any) from the first query's position | "sliding": per query token
    causal: bool = True  # queries of one step see each other causally (DFlash full layers: not)
    state_bytes: int = 0  # state: bytes per request per layer
    pool: int = 1  # pooled: tokens per entry
    ring: int = 0  # ring: slots per request

    def __post_init__(self):
        check_choice("cache replication", self.replication, DRAFT_KV_MODES)
        if self.kind not in KINDS:
            raise QualError(f"KV cache spec kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
        if self.kind in PER_REQUEST and self.sharded:
            raise QualError(f"a {self.kind} cache holds a fixed amount per request, not a sequence: it must be replicated")
        if self.kind == "ring" and self.ring < 1:
            raise QualError(f"a ring cache needs >= 1 slot per request (got {self.ring})")
        if self.pool < 1:
            raise QualError(f"pool must be >= 1 (got {self.pool})")

    @property
    def sharded(self) -> bool:
        return self.replication == SHARDED

    def entry_bytes(self) -> int:
        """Bytes one cache entry (a token, or a pool for "pooled") costs per layer (0 for a state)."""
        if self.kind == "gqa":
            return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes
        if self.kind in ("latent", "pooled", "ring"):
            return self.head_dim * self.dtype_bytes
        return 0

    def entries(self, num_tokens: int) -> int:
        """Cache positions a sequence of num_tokens occupies (pooled: its complete pools)."""
        return num_tokens // self.pool if self.kind == "pooled" else num_tokens

    def tokens_within(self, entries: int) -> int:
        """The longest sequence whose entries() fit in `entries` cache positions."""
        return (entries + 1) * self.pool - 1 if self.kind == "pooled" else entries


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share one block table."""

    name: str
    spec: KVCacheSpec
    layers: tuple[str, ...]

    def merge(self, other: "KVCacheGroup") -> "KVCacheGroup":
        """One table for both groups' layers; only identical specs may share it."""
        if self.spec.sharded != other.spec.sharded:
            raise QualError(
                f"cannot merge KV cache groups {self.name!r} ({self.spec.replication}) and {other.name!r} "
                f"({other.spec.replication}): groups of different replication never share a block table"
            )
        if self.spec != other.spec:
            raise QualError(f"cannot merge KV cache groups {self.name!r} and {other.name!r}: specs differ ({self.spec} vs {other.spec})")
        return KVCacheGroup(self.name, self.spec, self.layers + other.layers)

    def block_bytes(self, block_size: int) -> int:
        """Bytes one block id costs on one rank, every layer of the group (a state group's block is one request's state)."""
        s = self.spec
        if s.kind == "state":
            return len(self.layers) * s.state_bytes
        if s.kind == "ring":
            return len(self.layers) * s.ring * s.entry_bytes()
        return len(self.layers) * block_size * s.entry_bytes()


class BlockPool:
    """Free list of physical block ids."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"block pool exhausted: need {n}, have {len(self._free)}")
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(i for i in ids if i >= 0)


class CacheManager:
    """Block tables of every request in every group, with lifetime reservations for admission."""

    def __init__(self, groups: list[KVCacheGroup], block_size: int, dcp_size: int, memory_bytes: int, lookahead: int,
                 max_len: int | None = None, admission_dcp: int | None = None):
        self.groups = {g.name: g for g in groups}
        self.block_size = block_size
        self.dcp_size = dcp_size
        # The DCP size admission reckons reservations at (ParallelConfig.admission_dcp; None: dcp_size). Its blocks
        # per request are never fewer than dcp_size's, so what it admits the pools can hold.
        self.admission_dcp = dcp_size if admission_dcp is None else admission_dcp
        if dcp_size % self.admission_dcp:
            raise ValueError(f"admission at DCP {self.admission_dcp} cannot bound DCP {dcp_size}'s blocks")
        self.lookahead = lookahead  # tokens written past the committed length (verify block)
        per_index = sum(g.block_bytes(block_size) for g in groups)
        self.num_blocks = memory_bytes // per_index
        if self.num_blocks < 1:
            raise QualError(f"KV memory budget {memory_bytes} B is below one block ({per_index} B per block index)")
        self.pools = {g.name: BlockPool(self.num_blocks) for g in groups}
        self.tables: dict[str, dict[str, list[int]]] = {g.name: {} for g in groups}
        self.reserved: dict[str, dict[str, int]] = {g.name: {} for g in groups}
        # Per group, blocks reserved and not held: every request's reservation less the blocks its table holds
        # (kept as they change, where admission used to count every table's blocks for every request it admitted)
        self.owed: dict[str, int] = {g.name: 0 for g in groups}
        # Per group, every live request's reservation reckoned at admission_dcp: the pool less these is what admission
        # may still promise (the same as the free blocks less those owed, at admission_dcp == dcp_size)
        self.promised: dict[str, int] = {g.name: 0 for g in groups}
        self._promises: dict[str, dict[str, int]] = {g.name: {} for g in groups}
        self.peak_blocks: dict[str, int] = {g.name: 0 for g in groups}
        # The groups whose blocks leave a window (release_outside_window has work only there)
        self.windowed = tuple(g.name for g in groups if g.spec.window is not None)
        # The others get a request's blocks at admission, up to max_len tokens' worth (the longest a decode step's
        # static table reaches): its reservation holds them anyway, and a table that never changes need not travel
        # again (tables_changed). Their memory record counts the blocks that hold positions (ensure), as if the
        # blocks were taken as the request grew.
        self.max_len = max_len
        self._in_use: dict[str, dict[str, int]] = {g.name: {} for g in groups if g.spec.window is None}
        self._in_use_total = {name: 0 for name in self._in_use}
        # Requests whose tables changed since the last decode launch that sent tables (tables_sent)
        self.changed: set[str] = set()
        # Per request, the most tokens its blocks hold slots for (up to the last block's end): tables never shrink (a
        # block behind a window is freed in place), so ensure() for no more has nothing to do. Asked for every row of
        # every decode launch, where the answer is nearly always "nothing".
        self._ensured: dict[str, int] = {}

    def group_dcp(self, name: str, dcp_size: int | None = None) -> int:
        """The DCP size a group's tokens are spread over: the engine's (or dcp_size) where it is sharded, else 1."""
        return (self.dcp_size if dcp_size is None else dcp_size) if self.groups[name].spec.sharded else 1

    def lifetime_blocks(self, name: str, total_len: int, dcp_size: int | None = None) -> int:
        """Most blocks a request of total_len tokens ever holds at once in this group (at dcp_size: the engine's)."""
        spec = self.groups[name].spec
        if spec.kind in PER_REQUEST:
            return 1
        n = self.group_dcp(name, dcp_size)
        full = blocks_needed(spec.entries(total_len), self.block_size, n)
        window = self.groups[name].spec.window
        if window is None:
            return full
        return min(full, blocks_needed(window + self.lookahead, self.block_size, n) + 1)

    def can_admit(self, total_len: int) -> bool:
        """Admit only if every group can hold the request for its whole life, reckoned at admission_dcp: whether it
        is admitted then depends on the live requests' lengths alone, not on the DCP size where that is 1."""
        for name, pool in self.pools.items():
            if self.num_blocks - self.promised[name] < self.lifetime_blocks(name, total_len, self.admission_dcp):
                return False
            if pool.num_free - self.owed[name] < self.lifetime_blocks(name, total_len):
                return False
        return True

    def admit(self, req_id: str, total_len: int) -> None:
        if not self.can_admit(total_len):
            raise RuntimeError(f"request {req_id} does not fit the KV cache")
        for name in self.groups:
            reserved = self.reserved[name][req_id] = self.lifetime_blocks(name, total_len)
            self.owed[name] += reserved
            promise = self._promises[name][req_id] = self.lifetime_blocks(name, total_len, self.admission_dcp)
            self.promised[name] += promise
            if name in self._in_use:
                cap = reserved if self.max_len is None else min(reserved, self.lifetime_blocks(name, self.max_len))
                self.tables[name][req_id] = self.pools[name].allocate(cap)
                self.owed[name] -= cap
                self._in_use[name][req_id] = 0
            else:
                self.tables[name][req_id] = []
        self._ensured.pop(req_id, None)
        self.changed.add(req_id)

    def first_needed(self, name: str, num_tokens: int) -> int:
        """Lowest position a windowed group can still read once positions < num_tokens have slots: the step that
        writes up to num_tokens - 1 queries from num_tokens - lookahead on, and sees window positions behind that."""
        window = self.groups[name].spec.window
        return 0 if window is None else max(0, num_tokens - self.lookahead - window)

    def ensure(self, req_id: str, num_tokens: int) -> None:
        """Blocks so positions < num_tokens have slots in every group: a windowed group's taken now (skipping those
        already behind its window: a long prompt's early positions are never read there, nor stored), the others'
        counted as used (taken at admission; past max_len, taken now)."""
        if num_tokens <= self._ensured.get(req_id, -1):
            return
        held = 1 << 62  # the most tokens every group's blocks now hold slots for
        for name, pool in self.pools.items():
            table = self.tables[name][req_id]
            spec = self.groups[name].spec
            span = self.block_size * self.group_dcp(name)
            need = 1 if spec.kind in PER_REQUEST else blocks_needed(spec.entries(num_tokens), self.block_size, self.group_dcp(name))
            if need > len(table):  # windowed, or past max_len
                skip = 0 if spec.kind in PER_REQUEST else self.first_needed(name, num_tokens) // span
                fresh = range(max(len(table), skip), need)
                table.extend([-1] * (need - len(table) - len(fresh)))
                table.extend(pool.allocate(len(fresh)))
                self.owed[name] -= len(fresh)
                self.changed.add(req_id)
                if spec.window is None and len(table) > self.reserved[name][req_id]:  # the engine's tail is short
                    raise RuntimeError(f"request {req_id} holds {len(table)} blocks of {name}, reserved "
                                       f"{self.reserved[name][req_id]} (writes up to position {num_tokens - 1})")
            in_use = self._in_use.get(name)
            if in_use is None:
                self.peak_blocks[name] = max(self.peak_blocks[name], pool.num_blocks - pool.num_free)
                covered = len(table)
            else:  # blocks taken at admission: those holding positions now count as used
                covered = max(need, in_use[req_id])
                self._in_use_total[name] += covered - in_use[req_id]
                in_use[req_id] = covered
                self.peak_blocks[name] = max(self.peak_blocks[name], self._in_use_total[name])
            if spec.kind not in PER_REQUEST:  # one block each, whatever the length
                held = min(held, spec.tokens_within(covered * span))
        # Up to the blocks' end, not just num_tokens: a launch asks for a few tokens more than the last one, and
        # those nearly always fall in blocks already held
        self._ensured[req_id] = held

    def release_outside_window(self, name: str, req_id: str, context_len: int) -> None:
        """Free blocks whose positions have all left the group's window (they are never read again).

        context_len: the context the next step sees (its first query sits at context_len)."""
        window = self.groups[name].spec.window
        if window is None:
            return
        span = self.block_size * self.group_dcp(name)
        first_visible = max(0, context_len - window)
        table = self.tables[name][req_id]
        for vblk in range(min(first_visible // span, len(table))):
            if table[vblk] >= 0:
                self.pools[name].free([table[vblk]])
                table[vblk] = -1
                self.owed[name] += 1
                self.changed.add(req_id)

    def free(self, req_id: str) -> None:
        self._ensured.pop(req_id, None)
        self.changed.discard(req_id)
        for name, pool in self.pools.items():
            table = self.tables[name].pop(req_id, [])
            pool.free(table)
            self.owed[name] -= self.reserved[name].pop(req_id, 0) - sum(1 for b in table if b >= 0)
            self.promised[name] -= self._promises[name].pop(req_id, 0)
            if name in self._in_use:
                self._in_use_total[name] -= self._in_use[name].pop(req_id, 0)

    def tables_changed(self, req_ids: list[str]) -> bool:
        """Whether any of these requests' tables changed since tables_sent(): a decode launch ahead whose rows' tables
        did not leaves the device's copy of them as the last launch sent it."""
        return not self.changed.isdisjoint(req_ids)

    def tables_sent(self) -> None:
        """A decode launch sent its rows' tables. Requests outside its rows reach a launch's rows only in a launch
        that sends tables (a new run's first launch, or a join), so what changed for them need not be kept."""
        self.changed.clear()

    def block_rows(self, name: str, req_ids: list[str]) -> list[list[int]]:
        """Each request's block ids (copies), unpadded: what a step carries. The rank pads them once, to the width
        its step runs at (a decode graph's, a prefill bucket's), in one tensor or none (prefill_graphs)."""
        return [list(self.tables[name][r]) for r in req_ids]

    def memory(self) -> dict[str, dict]:
        """Per-rank KV bytes by group: what the pool holds and what live blocks use."""
        report = {}
        for name, g in self.groups.items():
            bb = g.block_bytes(self.block_size)
            used = self._in_use_total[name] if name in self._in_use else sum(sum(1 for b in t if b >= 0)
                                                                             for t in self.tables[name].values())
            report[name] = {
                "kind": g.spec.kind,
                "replication": g.spec.replication,
                "window": g.spec.window,
                "block_bytes": bb,
                "num_blocks": self.num_blocks,
                "pool_bytes": bb * self.num_blocks,
                "used_blocks": used,
                "used_bytes": used * bb,
                "peak_bytes": self.peak_blocks[name] * bb,
            }
        return report


def table_tensor(rows: list[list[int]]) -> torch.Tensor:
    """Block-id rows as one [R, longest row] tensor, -1 padded (an eager prefill's tables; a decode step's are
    packed with its numbers: step_args.pack)."""
    width = max(max((len(r) for r in rows), default=0), 1)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long).view(len(rows), width)
