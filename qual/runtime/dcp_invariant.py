"""Attention under DCP that computes DCP 1's bits at every DCP size: `dcp_comm: invariant` (docs/dcp.md, "The
invariant merge").

The sequence is cut into V = DCP_VIRTUAL_SHARDS virtual shards: position p belongs to shard v = (p // I) % V, and
shard v lives on DCP rank v % N, which is where docs/dcp.md's sharding puts p when N divides V (the cache layout is
the usual one). Every rank computes, for each shard it holds, the shard's partial (max score, sum of exponentials,
exponential-weighted sum of values) over the shard's keys in position order, with elementwise operations and sums in
a pairing fixed by the key's index in its shard (tree_sum): its bits depend on the query and the shard's keys alone,
not on how many shards the rank holds, which heads or requests share the tensors, or how wide the key view is (a
GEMM's rounding depends on its shape: this host's BLAS picks kernels by row count). The partials then merge in one
fixed tree, v with v + V/2, then v + V/4, ...: the first log2(V/N) levels inside the rank, the last log2 N after one
all-to-all of the partials. DCP 1 runs the same tree, so every merge sees the same operands at every N and rounds
the same; with the same batches (ParallelConfig.admission_dcp), DCP N's target is DCP 1's bit for bit, layer after
layer.
"""

from __future__ import annotations

import torch

from qual.runtime.config import DCP_VIRTUAL_SHARDS
from qual.runtime.parallel import Comm

# Elements of one chunk's products (queries x keys x head dims): bounds the scratch memory without changing a value
# (each query row's partials are computed from that row alone).
_CHUNK = 1 << 20
_NEG_INF = float("-inf")


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over dim by adjacent pairs, ((x0 + x1) + (x2 + x3)) + ..., an odd last element carried up a level.

    Which element pairs with which depends on its index alone, so zeros appended (a wider key view, padding, keys
    masked out) change no bit of the sum of the ones before them; and the additions are elementwise, so neighbours
    in the other dimensions do not change them either (a reduction kernel's order depends on the whole shape)."""
    dim = dim % x.dim()
    if x.shape[dim] == 0:
        return x.sum(dim)
    lead = (slice(None),) * dim
    while x.shape[dim] > 1:
        n = x.shape[dim]
        even = n - n % 2
        halves = x[lead + (slice(0, even, 2),)] + x[lead + (slice(1, even, 2),)]
        x = halves if n == even else torch.cat([halves, x.narrow(dim, even, 1)], dim)
    return x.squeeze(dim)


def by_shard(x: torch.Tensor, dim: int, shards: int, interleave: int, fill) -> torch.Tensor:
    """A rank's local keys along dim (local order: run j // I of I positions is global run N * (j // I) + r) ->
    [..., shards, n, ...]: shard c = this rank's c-th virtual shard (v = r + N c), its keys in position order,
    padded with `fill` to whole runs."""
    dim = dim % x.dim()
    unit = shards * interleave
    pad = -x.shape[dim] % unit
    if pad:
        x = torch.cat([x, x.new_full((*x.shape[:dim], pad, *x.shape[dim + 1:]), fill)], dim)
    runs = x.shape[dim] // unit
    x = x.unflatten(dim, (runs, shards, interleave)).transpose(dim, dim + 1)  # [.., shards, runs, I, ..]
    return x.flatten(dim + 1, dim + 2)


def shard_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The partial of each virtual shard: q [R, Q, Hk, G, D], keys k [R, C, n, Hk, D] and values v [R, C, n, Hk, Dv]
    by shard (by_shard), mask [R, Q, C, n] -> [R, Q, C, Hk, G, Dv + 2]: per query head, sum_s e_s v_s, then the
    max score m, then sum_s e_s, where e_s = exp(score_s - m) (m = -inf, sums 0 where the shard shows nothing)."""
    # Operands laid out for the products (a broadcast over strided views is many times slower): keys innermost
    kt = k.permute(0, 1, 3, 4, 2).contiguous()  # [R, C, Hk, D, n]
    prod = q[:, :, None, :, :, :, None] * kt[:, None, :, :, None]  # [R, Q, C, Hk, G, D, n]
    scores = tree_sum(prod, -2) * scale  # [R, Q, C, Hk, G, n]
    scores = scores.masked_fill(~mask[:, :, :, None, None, :], _NEG_INF)
    m = scores.amax(-1)  # exact in any order
    e = torch.exp(scores - torch.where(m > _NEG_INF, m, 0.0)[..., None])  # a masked key: exp(-inf) = 0
    vt = v.permute(0, 1, 3, 2, 4).contiguous()  # [R, C, Hk, n, Dv]
    out = tree_sum(e[..., None] * vt[:, None, :, :, None], -2)  # [R, Q, C, Hk, G, Dv]
    return torch.cat([out, m[..., None], tree_sum(e, -1)[..., None]], -1)


def merge_halves(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """One level of the merge tree: entry i with entry i + n/2 along dim (n even) of partials [..., Dv + 2]."""
    h = parts.shape[dim] // 2
    a, b = parts.narrow(dim, 0, h), parts.narrow(dim, h, h)
    m = torch.maximum(a[..., -2], b[..., -2])
    base = torch.where(m > _NEG_INF, m, 0.0)
    wa, wb = torch.exp(a[..., -2] - base), torch.exp(b[..., -2] - base)  # 0 for an empty side
    total = wa * a[..., -1] + wb * b[..., -1]
    out = wa[..., None] * a[..., :-2] + wb[..., None] * b[..., :-2]
    return torch.cat([out, m[..., None], total[..., None]], -1)


def merge_tree(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """Merge the partials along dim (a power of two long) by halving: i with i + n/2, then i + n/4, ..."""
    while parts.shape[dim] > 1:
        parts = merge_halves(parts, dim)
    return parts.squeeze(dim)


def finish(parts: torch.Tensor) -> torch.Tensor:
    """Merged partials [..., Dv + 2] -> attention output [..., Dv] (0 where nothing was visible)."""
    total = parts[..., -1:]
    return torch.where(total > 0, parts[..., :-2] / total, 0.0)


def local_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, shards: int,
                   interleave: int) -> torch.Tensor:
    """This rank's shards, merged: q [R, Q, H, D] (accumulation dtype), local keys k [R, S, Hk, D], values
    v [R, S, Hk, Dv], mask [R, Q, S] -> [R, Q, H, Dv + 2], the first log2(shards) levels of the tree done."""
    R, Q, H, D = q.shape
    Hk = k.shape[2]
    q = q.reshape(R, Q, Hk, H // Hk, D)
    k, v = by_shard(k, 1, shards, interleave, 0), by_shard(v, 1, shards, interleave, 0)
    mask = by_shard(mask, 2, shards, interleave, False)
    per_query = H * k.shape[1] * k.shape[2] * max(D, v.shape[-1])  # one query row's products
    requests = max(1, _CHUNK // (per_query * Q))  # per chunk; a request too large alone is cut into even query runs
    queries = Q if requests > 1 or per_query * Q <= _CHUNK else -(-Q // -(-Q * per_query // _CHUNK))
    parts = torch.cat([
        torch.cat([shard_partials(q[r0:r0 + requests, q0:q0 + queries], k[r0:r0 + requests], v[r0:r0 + requests],
                                  mask[r0:r0 + requests, q0:q0 + queries], scale) for q0 in range(0, Q, queries)], 1)
        for r0 in range(0, R, requests)])
    return merge_tree(parts, 2).flatten(2, 3)  # [R, Q, Hk, G, Dv + 2] -> heads in order


def invariant_attention(comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float, local_heads: int) -> torch.Tensor:
    """Steps 2 and 3 of attention under DCP, by the invariant merge: q [R, Q, N*Hl, D] (the DCP group's query heads,
    in DCP rank order), this rank's keys k [R, S, Hk, D] and values v [R, S, Hk, Dv] (local order), mask [R, Q, S]
    -> this rank's heads [R, Q, Hl, Dv] in q's dtype. Computed in at least float32; the wire carries that dtype."""
    N, Hl = comm.dcp_size, local_heads
    acc = torch.promote_types(q.dtype, torch.float32)
    parts = local_partials(q.to(acc), k.to(acc), v.to(acc), mask, scale, DCP_VIRTUAL_SHARDS // N, comm.interleave)
    R, Q, _, width = parts.shape
    # Each rank gets every rank's partial of its own heads: [N (source rank = the merged shards' v % N), R, Q, Hl, .]
    parts = comm.all_to_all_dcp(parts.view(R, Q, N, Hl, width).permute(2, 0, 1, 3, 4).contiguous())
    return finish(merge_tree(parts, 0)).to(q.dtype)
