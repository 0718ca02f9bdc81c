"""MLA in the absorbed form: the cache holds one normalised latent per token, attention runs in latent space.

The key of head h for token s is W_uk[h] c_s and its value W_uv[h] c_s, so q . k = (W_uk[h]^T q) . c_s and the
attention output is W_uv[h] (sum_s p_s c_s). Scoring and the weighted sum both happen over the latents c (one
shared "KV head"), which is why the latent cache is replicated on every TP rank and a DCP merge is a merge of
latent-space partial outputs.

With MLA RoPE (qk_rope_head_dim R > 0 and not mla_use_nope, vLLM's form) each head's query ends in R dims rotated
as interleaved pairs, and every token has one shared R-dim key k_pe (the last R rows of kv_a_proj_with_mqa, not
normed, rotated at its position): the cache entry is [latent | k_pe], scores are q_lat . c + q_pe . k_pe, and
values are the latents alone. Under NoPE (R = 0, or mla_use_nope: k_pe is zero) the cache holds the latent only.

Token-wise functions take flat tokens [T, ...]; the attention takes a padded batch [R, Q, ...] of queries over
[R, S] cached latents selected by a boolean mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qual.runtime.attention import attention_with_lse
from qual.runtime.models.glm5.common import acc_dtype
from qual.runtime.models.layers import rms_norm


@dataclass
class MlaWeights:
    """One MLA layer; H = num_attention_heads / tp heads on this rank, the latent path replicated."""

    q_a: torch.Tensor  # [q_lora, hidden] (replicated: the indexer reads the same residual)
    q_a_norm: torch.Tensor  # [q_lora]
    q_b: torch.Tensor  # [H*(Dn+Dr), q_lora] column-parallel by head
    kv_a: torch.Tensor  # [L, hidden] (replicated: one latent per token)
    kv_a_norm: torch.Tensor  # [L]
    w_uk: torch.Tensor  # [H, Dn, L] key up-projection (kv_b_proj rows of each head's keys)
    w_uv: torch.Tensor  # [H, Dv, L] value up-projection
    o_proj: torch.Tensor  # [hidden, H*Dv] row-parallel
    eps: float
    scale: float  # (Dn + Dr)^-0.5: qk_rope_head_dim counts under mla_use_nope too
    rope_dim: int = 0  # R: the rotated dims of a query head and of k_pe (0: NoPE)

    @property
    def num_heads(self) -> int:
        return self.w_uk.shape[0]

    @property
    def latent_dim(self) -> int:
        return self.kv_a_norm.shape[0]


def mla_q_resid(w: MlaWeights, x: torch.Tensor) -> torch.Tensor:
    """The normalised low-rank query [T, q_lora] (input of q_b and of the DSA indexer)."""
    return rms_norm(F.linear(x, w.q_a), w.q_a_norm, w.eps)


def mla_latent(w: MlaWeights, x: torch.Tensor, rope=None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token cache entry [T, L (+ R)]: kv_a_proj_with_mqa's latent rows through its RMSNorm, then (MLA
    RoPE) its k_pe rows rotated at the token's position."""
    kv = F.linear(x, w.kv_a)
    latent = rms_norm(kv[:, :w.latent_dim], w.kv_a_norm, w.eps)
    if not w.rope_dim:
        return latent
    k_pe = rope(kv[:, None, w.latent_dim:], positions)[:, 0]  # one key head shared by every query head
    return torch.cat([latent, k_pe.to(latent.dtype)], dim=-1)


def mla_absorbed_query(w: MlaWeights, q_resid: torch.Tensor, rope=None,
                       positions: torch.Tensor | None = None) -> torch.Tensor:
    """Queries moved into latent space, [T, H, L (+ R)]: q_lat[h] = W_uk[h]^T q_nope[h], then (MLA RoPE) the
    head's rotated q_pe. Under mla_use_nope the q_pe dims are computed by q_b_proj and meet a zero key: dropped."""
    T, H, Dn = q_resid.shape[0], w.num_heads, w.w_uk.shape[1]
    q = F.linear(q_resid, w.q_b).view(T, H, -1)  # [T, H, Dn + R]: nope dims first
    q_lat = torch.einsum("thn,hnl->thl", q[..., :Dn], w.w_uk)
    if not w.rope_dim:
        return q_lat
    return torch.cat([q_lat, rope(q[..., Dn:], positions).to(q_lat.dtype)], dim=-1)


def latent_attention(q_lat: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor, scale: float, latent_dim: int):
    """Attend over a subset of cached latents.

    q_lat [R, Q, H, L (+ R)], latents [R, S, L (+ R)] (cache entries), mask [R, Q, S] (True = attend) ->
    (out [R, Q, H, L] in latent space, lse [R, Q, H]); a query seeing nothing gets out 0 and lse -inf, so
    partial results over disjoint latent subsets merge exactly with qual.runtime.attention.combine_lse.
    Keys are whole entries, values their first latent_dim (L) dims. Computed in at least float32.
    """
    q, k = latent_inputs(q_lat, latents)
    return attention_with_lse(q, k, k[..., :latent_dim], mask, scale)


def latent_inputs(q_lat: torch.Tensor, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [R, Q, H, L (+ R)] and cache entries [R, S, L (+ R)] as attention takes them: in at least float32,
    the entries as one key head [R, S, 1, L (+ R)] that serves every query head (their first L dims the values)."""
    acc = acc_dtype(q_lat.dtype)
    return q_lat.to(acc), latents.to(acc).unsqueeze(2)


def mla_output(w: MlaWeights, out_lat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Latent-space attention output [T, H, L] -> W_uv per head -> o_proj: this rank's partial [T, hidden]."""
    v = torch.einsum("thl,hvl->thv", out_lat.to(w.w_uv.dtype), w.w_uv).to(dtype)  # [T, H, Dv]
    return F.linear(v.reshape(v.shape[0], -1), w.o_proj)
