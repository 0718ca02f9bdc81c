"""DSA indexer with KPool compression, decomposed the way a paged, DCP-sharded engine stores it.

Per request and full indexer layer there are two caches:
  - the index-key cache: one pooled (compressed) key per complete pool of `kpool` tokens; pools are the
    DCP sharding unit (see topk.pool_owner);
  - a small replicated tail ring with the raw key and gate score of recent positions (slot = pos % ring),
    from which the pool in progress is compressed when its last token arrives. Its size leaves room for
    speculative drafts: see tail_ring_size.
A query at position p may select pool j when the pool is complete and its last token is visible:
(j + 1) * kpool - 1 <= p. It takes the best index_topk / kpool such pools (topk.py), expanded to their
tokens, plus (always-select-tail) its own incomplete pool's visible tokens as raw positions.
Token-wise functions take flat tokens [T, ...].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qual.errors import QualError
from qual.runtime.models.glm5.common import next_power_of_2
from qual.runtime.models.glm5.numerics import fp8_dequant_rows, linear, pool_fp8, rotate_quant_fp8
from qual.runtime.models.glm5.topk import local_topk


@dataclass
class IndexerWeights:
    """One full indexer layer (replicated on every TP rank, as vLLM does)."""

    wq_b: torch.Tensor  # [Hi*Di, q_lora] (an FP8 weight under vLLM's numerics, where the checkpoint stores it so)
    wk: torch.Tensor  # [Di, hidden]
    k_norm_weight: torch.Tensor  # [Di] LayerNorm (eps 1e-6)
    k_norm_bias: torch.Tensor  # [Di]
    weights_proj: torch.Tensor  # [Hi, hidden] per-head weights of the score sum
    compress_gate: torch.Tensor  # [Di, hidden] per-channel pooling logits
    compress_ape: torch.Tensor  # [kpool, Di] position-in-pool bias of the logits (accumulation dtype)
    select_pools: int  # index_topk // kpool
    select_tail: bool
    rope_dim: int = 0  # qk_rope_head_dim: the first R dims of each query head and of the key rotate (vLLM)
    rope_interleave: bool = False  # indexer_rope_interleave: pairs (2i, 2i+1), else rotate-half
    # vLLM's FP8 indexer (numerics vllm): queries and pooled keys Hadamard-rotated and FP8, head weights in float32
    fp8: bool = False

    @property
    def kpool(self) -> int:
        return self.compress_ape.shape[0]

    @property
    def head_dim(self) -> int:
        return self.wk.shape[0]

    @property
    def n_heads(self) -> int:
        return self.weights_proj.shape[0]

    @property
    def acc(self) -> torch.dtype:
        return self.compress_ape.dtype


@dataclass
class IndexKeyCache:
    """One request's index keys for one full layer."""

    pooled: torch.Tensor  # [P, Di]: row j = compressed key of pool j (rows past the complete pools are stale)
    ring_k: torch.Tensor  # [ring, Di]: raw key of position p at slot p % ring
    ring_gate: torch.Tensor  # [ring, Di]: its gate score


def tail_ring_size(kpool: int, num_speculative_tokens: int) -> int:
    """Slots of the tail ring: kpool * next_pow2(ceil((kpool + K) / kpool)) (vLLM's sizing).

    A verify step writes K + 1 positions; if a draft completing a pool is rejected, the redo recompresses that
    pool from its first kpool - 1 positions, so those must survive the drafts written behind it: the ring needs
    at least kpool + K distinct slots.
    """
    return kpool * next_power_of_2(-(-(kpool + num_speculative_tokens) // kpool))


def new_index_cache(w: IndexerWeights, ring: int, dtype: torch.dtype, device=None) -> IndexKeyCache:
    """An empty cache for a new request."""
    if ring < w.kpool:
        raise QualError(f"tail ring of {ring} slots cannot hold a pool of {w.kpool} tokens")
    Di = w.head_dim
    zeros = lambda n: torch.zeros(n, Di, dtype=dtype, device=device)  # noqa: E731
    return IndexKeyCache(zeros(0), zeros(ring), zeros(ring))


def index_query(w: IndexerWeights, x: torch.Tensor, q_resid: torch.Tensor, rope=None,
                positions: torch.Tensor | None = None):
    """Index queries [T, Hi, Di] (the first rope_dim dims of each head rotated at its position) and head weights
    [T, Hi] (with the Hi^-0.5 factor), accumulation dtype.

    FP8 (vLLM's Indexer.forward): each head's query Hadamard-rotated and quantized (fwht128_quant_fp8), its e4m3
    values returned as the query, and its scale folded into the head weight with Di^-0.5 * Hi^-0.5 (vLLM's
    _fused_indexer_weight_scale); the head weights come from a float32 GEMM. Score them with score_scale(w)."""
    T = x.shape[0]
    q = linear(q_resid, w.wq_b).view(T, w.n_heads, w.head_dim)
    if w.rope_dim:
        q = torch.cat([rope(q[..., :w.rope_dim], positions), q[..., w.rope_dim:]], dim=-1)
    if not w.fp8:
        return q.to(w.acc), F.linear(x, w.weights_proj).to(w.acc) * w.n_heads**-0.5
    q8, q_scale = rotate_quant_fp8(q)
    weights = F.linear(x.to(w.acc), w.weights_proj.to(w.acc))  # [T, Hi]
    return q8.to(w.acc), weights * q_scale.to(w.acc) * (w.head_dim**-0.5 * w.n_heads**-0.5)


def score_scale(w: IndexerWeights) -> float:
    """The factor inside an index score's ReLU: Di^-0.5, or 1 where the FP8 head weights carry it."""
    return 1.0 if w.fp8 else w.head_dim**-0.5


def pool_keys(w: IndexerWeights, k: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """k, gate [P, kpool, Di] -> pooled keys [P, Di]: compress_pools, or (FP8) vLLM's kpool kernel, each pooled key
    rotated and quantized and held as its exact value in k's dtype."""
    if not w.fp8:
        return compress_pools(k, gate, w.compress_ape)
    return fp8_dequant_rows(*pool_fp8(k, gate, w.compress_ape), k.dtype)


def index_key(w: IndexerWeights, x: torch.Tensor, rope=None, positions: torch.Tensor | None = None):
    """Raw index key [T, Di] (wk, LayerNorm, then its first rope_dim dims rotated at the token's position: pools
    compress rotated keys) and pooling gate score [T, Di] of each token."""
    k = F.layer_norm(F.linear(x, w.wk).to(w.acc), (w.head_dim,), w.k_norm_weight.to(w.acc),
                     w.k_norm_bias.to(w.acc), 1e-6).to(x.dtype)
    if w.rope_dim:
        k = torch.cat([rope(k[:, None, :w.rope_dim], positions)[:, 0], k[:, w.rope_dim:]], dim=-1)
    return k, F.linear(x, w.compress_gate)


def compress_pools(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """k, gate [P, kpool, Di] -> pooled keys [P, Di]: per channel, a softmax over the pool's tokens of gate + ape."""
    probs = torch.softmax(gate.to(ape.dtype) + ape, dim=1).to(k.dtype)
    return (probs * k).sum(1)


def append_index_keys(cache: IndexKeyCache, start: int, k: torch.Tensor, gate: torch.Tensor,
                      ape: torch.Tensor) -> IndexKeyCache:
    """Add positions start .. start+T-1 (k, gate [T, Di]): compress every pool they complete, stash them in the
    ring. Pools completed again (a redo after a rejected draft) are overwritten. Returns a new cache."""
    kpool, ring, T = ape.shape[0], cache.ring_k.shape[0], k.shape[0]
    s0 = start // kpool * kpool  # first position of the pool in progress
    held = torch.arange(s0, start, device=k.device) % ring
    raw_k, raw_g = torch.cat([cache.ring_k[held], k]), torch.cat([cache.ring_gate[held], gate])
    first, last = start // kpool, (start + T) // kpool  # pools first .. last-1 complete now
    pooled = cache.pooled
    if first > pooled.shape[0]:
        raise QualError(f"index-key cache holds {pooled.shape[0]} pools, position {start} needs {first}")
    if last > first:
        n = last - first
        new = compress_pools(raw_k[: n * kpool].view(n, kpool, -1), raw_g[: n * kpool].view(n, kpool, -1), ape)
        pooled = torch.cat([pooled[:first], new, pooled[last:]])
    keep = min(T, ring)  # only the last `ring` positions can be held
    slots = torch.arange(start + T - keep, start + T, device=k.device) % ring
    ring_k, ring_g = cache.ring_k.clone(), cache.ring_gate.clone()
    ring_k[slots], ring_g[slots] = k[T - keep:], gate[T - keep:]
    return IndexKeyCache(pooled, ring_k, ring_g)


def pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` by halving (the first half plus the second, an odd last element carried): an order that
    depends on that dimension's length alone. A reduction kernel's order depends on the whole tensor's shape and on
    the hardware; elementwise additions round the same way for every element wherever it sits."""
    n = x.shape[dim]
    while n > 1:
        h = n // 2
        halves = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
        x = halves if n % 2 == 0 else torch.cat([halves, x.narrow(dim, 2 * h, 1)], dim)
        n = x.shape[dim]
    return x.squeeze(dim)


# Elements of one chunk's products (q x pool key x head): bounds the scorer's scratch memory without changing a value.
_SCORE_CHUNK = 1 << 22


def pool_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Index scores sum_h w_h relu(q_h . k_p * scale) of every (query, pool), scale Di^-0.5 unless given.

    q [..., Hi, Di] and head_weights [..., Hi] per query, keys [..., P, Di] per pool (leading dims broadcast against
    the queries' but for one: pools are their own axis) -> [..., P]. Each score is computed from its own query and
    pool alone, by elementwise products, scaling, ReLU and pairwise sums in a fixed order: the same bits whichever
    pools sit beside it, however many there are and on whichever DCP rank (a GEMM rounds by its shape). So a tie or
    a near-tie at the k-th pool is decided the same way at every DCP size.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys = keys.to(q.dtype)
    P = keys.shape[-2]
    per_pool = q[..., :1, 0].numel() * q.shape[-2] * q.shape[-1]  # elements of one pool's products
    step = max(1, _SCORE_CHUNK // max(per_pool, 1))
    out = [q.new_zeros(q.shape[:-2] + (0,))]
    for p0 in range(0, P, step):
        k = keys[..., p0:p0 + step, :]  # [..., p, Di]
        prod = q.unsqueeze(-2) * k.unsqueeze(-3)  # [..., Hi, p, Di]
        s = F.relu(pairwise_sum(prod, -1) * scale)  # [..., Hi, p]
        out.append(pairwise_sum(head_weights.unsqueeze(-1) * s, -2))  # [..., p]
    return torch.cat(out, -1) if len(out) > 2 else out[-1]


def selectable_pools(q_pos: torch.Tensor, pool_ids: torch.Tensor, kpool: int) -> torch.Tensor:
    """[N, P]: pool complete with its last token visible to the query at q_pos [N] (causal)."""
    return (pool_ids[None, :] + 1) * kpool - 1 <= q_pos[:, None]


def expand_pools(pool_ids: torch.Tensor, q_pos: torch.Tensor, kpool: int, tail: bool) -> torch.Tensor:
    """Selected pools [N, k] (-1 = none) -> token positions [N, k*kpool (+ kpool-1 tail)], -1 = none.

    The tail is the query's own incomplete pool: positions floor((p+1)/kpool)*kpool .. p.
    """
    offs = torch.arange(kpool, device=pool_ids.device)
    tok = torch.where(pool_ids[..., None] >= 0, pool_ids[..., None] * kpool + offs, -1).flatten(1)
    if not tail or kpool == 1:
        return tok
    start = (q_pos + 1) // kpool * kpool
    t = start[:, None] + offs[:-1]
    return torch.cat([tok, torch.where(t <= q_pos[:, None], t, -1)], dim=1)


def selection_mask(token_ids: torch.Tensor, key_pos: torch.Tensor, length: int) -> torch.Tensor:
    """[N, S]: key at position key_pos[s] is among the row's token_ids [N, W] (-1 ignored); positions < length."""
    dense = torch.zeros(token_ids.shape[0], length + 1, dtype=torch.bool, device=token_ids.device)
    dense.scatter_(1, torch.where((token_ids >= 0) & (token_ids < length), token_ids, length), True)
    return dense[:, key_pos]


def select_tokens(w: IndexerWeights, q: torch.Tensor, head_weights: torch.Tensor, pooled: torch.Tensor,
                  q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-rank selection over all of a request's pools [P, Di] for queries at q_pos [N]:
    (token positions [N, W], selected pool ids [N, select_pools], margin [N]). The margin is the score gap
    between the last selected and the best dropped pool (inf when none is dropped): at 0 the tie-break decides."""
    ids = torch.arange(pooled.shape[0], device=pooled.device)
    scores = pool_scores(q, head_weights, pooled, score_scale(w))
    k = w.select_pools
    top_s, top = local_topk(scores, ids, selectable_pools(q_pos, ids, w.kpool), k + 1)
    dropped = top_s[:, k]
    margin = torch.where(dropped > float("-inf"), (top_s[:, k - 1] if k else dropped) - dropped,
                         torch.full_like(dropped, float("inf")))
    return expand_pools(top[:, :k], q_pos, w.kpool, w.select_tail), top[:, :k], margin
