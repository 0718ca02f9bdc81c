"""Steps 2 and 3 of attention under DCP (docs/dcp.md): attend the local KV shard, merge the DCP group's partial
results by their LSE.

Each rank attended its local KV shard with the whole group's query heads; afterwards each rank keeps
only its own heads. Shared by every attention that shards its cache along the sequence (GQA, MLA latent).
"""

from __future__ import annotations

import torch

from qual.options import INVARIANT
from qual.runtime.attention import attention_with_lse, combine_lse, global_lse, rescale_to_global
from qual.runtime.dcp_invariant import invariant_attention
from qual.runtime.parallel import Comm


def dcp_attention(comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                  local_heads: int, fused: bool = False) -> torch.Tensor:
    """The group's query heads q [R, Q, N*Hl, D] over this rank's keys k [R, S, Hk, D] and values v [R, S, Hk, Dv]
    (mask [R, Q, S]) -> this rank's heads [R, Q, Hl, Dv], merged by comm.dcp_comm: the invariant merge (DCP 1's bits
    at every DCP size, DCP 1 included), or attention_with_lse (fused: where it applies) and dcp_combine."""
    if comm.dcp_comm == INVARIANT:
        return invariant_attention(comm, q, k, v, mask, scale, local_heads)
    out, lse = attention_with_lse(q, k, v, mask, scale, fused=fused)
    return dcp_combine(comm, out, lse, local_heads) if comm.dcp_size > 1 else out


def dcp_combine(comm: Comm, out: torch.Tensor, lse: torch.Tensor, local_heads: int) -> torch.Tensor:
    """Partials out [R, Q, N*Hl, D] and lse [R, Q, N*Hl] of this rank -> merged output of its own heads [R, Q, Hl, D]."""
    N, Hl = comm.dcp_size, local_heads
    R, Q, _, D = out.shape
    if comm.dcp_comm == "a2a":
        # Send each rank (O_r, lse_r) for its heads, then merge the N partials locally: one collective.
        wire = torch.float32 if out.dtype in (torch.float16, torch.bfloat16) else out.dtype  # keep lse precise
        packed = torch.cat([out.to(wire), lse.to(wire).unsqueeze(-1)], dim=-1)  # [R, Q, N*Hl, D+1]
        packed = packed.view(R, Q, N, Hl, D + 1).permute(2, 0, 1, 3, 4).contiguous()
        parts = comm.all_to_all_dcp(packed)  # [N (source rank), R, Q, Hl, D+1]
        merged, _ = combine_lse(parts[..., :D], parts[..., D])
        return merged.to(out.dtype)
    # ag_rs: all-gather the LSEs, rescale locally, reduce-scatter the outputs back to their heads.
    lse_all = global_lse(comm.all_gather_dcp(lse))
    part = rescale_to_global(out, lse, lse_all)  # [R, Q, N*Hl, D]
    part = part.view(R, Q, N, Hl, D).permute(2, 0, 1, 3, 4).reshape(N * R, Q, Hl, D)
    return comm.reduce_scatter_dcp(part)
