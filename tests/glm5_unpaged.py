"""A test oracle: a plain, unpaged forward of the GLM-5.3-Flash text stack with in-memory per-request caches, built
from the runtime's blocks (qual/runtime/models/glm5/) without its paging, TP processes or DCP.

Prefill (in any number of pieces) runs one request at a time; verify runs R requests with Q new tokens each
and keeps the KDA state after every position until commit() says how many were accepted; decode is a verify
of one token. The caches per request: the MLA latent of every token (per indexed layer), the pooled index keys
and tail ring (per full indexer layer), the KDA conv and recurrent states (per linear layer and TP shard).

TP simulation: given the shards of tp ranks, every head-sharded part runs once per shard and the row-parallel
partial outputs are summed (the all-reduce); the replicated parts (MHC, norms, MLA latent, indexer, router)
run once from shard 0, whose copies are identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from qual.errors import QualError
from qual.runtime.models.glm5.dsa import (append_index_keys, index_key, index_query, new_index_cache, select_tokens,
                                          selection_mask, tail_ring_size)
from qual.runtime.models.glm5.kda import KdaState, kda_prefill, kda_state_at, kda_verify, kda_zero_state
from qual.runtime.models.glm5.mhc import hc_contract, hc_expand, hc_post, hc_pre
from qual.runtime.models.glm5.mla import latent_attention, mla_absorbed_query, mla_latent, mla_output, mla_q_resid
from qual.runtime.models.glm5.moe import mlp, moe
from qual.runtime.models.glm5.weights import Glm5Weights, load_glm5_weights
from qual.runtime.models.layers import rms_norm


@dataclass
class RequestState:
    """One request's caches; `length` tokens are committed."""

    length: int = 0
    latent: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [S, L]
    index: dict = field(default_factory=dict)  # full indexer layer -> IndexKeyCache
    kda: dict[int, list[KdaState]] = field(default_factory=dict)  # layer -> per TP shard, batch dim 1


@dataclass
class StepOutput:
    logits: torch.Tensor | None  # [R, Q, vocab]; None without an lm_head
    hidden: torch.Tensor  # [R, Q, hidden]: final norm of the stream mean
    aux: torch.Tensor | None  # [R, Q, len(aux_layer_ids) * hidden]: stream means after those layers, in that order
    attended: dict[int, list[torch.Tensor]]  # full indexer layer -> per request [Q, S] keys attended
    select_margin: float  # smallest score gap at a selection boundary (inf: nothing dropped); 0 = a tie decided


@dataclass
class Pending:
    """A verify's per-position KDA states, [R, Q, ...] per layer and shard, until commit()."""

    kda: dict[int, list[KdaState]]
    q: int


class Glm5Reference:
    """The whole text stack over the TP shards of one checkpoint (one shard: tp 1)."""

    def __init__(self, shards: Sequence[Glm5Weights], aux_layer_ids: Sequence[int] = (),
                 num_speculative_tokens: int = 0, kda_chunk: int = 64):
        self.shards, self.cfg = list(shards), shards[0].cfg
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.num_speculative_tokens = num_speculative_tokens
        self.ring = tail_ring_size(self.cfg.index_kpool, num_speculative_tokens)
        self.kda_chunk = kda_chunk
        bad = [i for i in self.aux_layer_ids if not 0 <= i < self.cfg.num_hidden_layers]
        if bad:
            raise QualError(f"aux layer id {bad[0]} is outside 0..{self.cfg.num_hidden_layers - 1}")

    @classmethod
    def load(cls, path: str | Path, tp_size: int = 1, dtype: torch.dtype = torch.float32, **kw) -> "Glm5Reference":
        """All tp_size shards of a checkpoint (the TP simulation when tp_size > 1)."""
        return cls([load_glm5_weights(path, r, tp_size, dtype) for r in range(tp_size)], **kw)

    def new_request(self) -> RequestState:
        """Empty caches for a new request."""
        return RequestState()

    def prefill(self, req: RequestState, tokens: torch.Tensor) -> StepOutput:
        """Run and commit the next piece tokens [T] of one request's prompt; outputs have R = 1."""
        out, _ = self._forward([req], tokens.reshape(1, -1), prefill=True)
        req.length += tokens.numel()
        return out

    def verify(self, reqs: Sequence[RequestState], tokens: torch.Tensor) -> tuple[StepOutput, Pending]:
        """Q tokens [R, Q] per request (the last accepted token then the drafts); nothing is committed yet."""
        if tokens.shape[1] > self.num_speculative_tokens + 1:
            raise QualError(f"verify of {tokens.shape[1]} tokens exceeds num_speculative_tokens + 1 = "
                            f"{self.num_speculative_tokens + 1} (the index tail ring is sized for that)")
        return self._forward(reqs, tokens, prefill=False)

    def commit(self, reqs: Sequence[RequestState], pending: Pending, accepted: Sequence[int]) -> None:
        """Keep the first accepted[r] (1..Q) verified tokens of each request."""
        for r, (req, a) in enumerate(zip(reqs, accepted)):
            if not 1 <= a <= pending.q:
                raise QualError(f"accepted={a} is outside 1..{pending.q}")
            req.length += a
            for i in req.latent:
                req.latent[i] = req.latent[i][: req.length]
            at = torch.tensor([a - 1])
            for i, per_shard in pending.kda.items():
                req.kda[i] = [kda_state_at(KdaState(s.conv[r:r + 1], s.recurrent[r:r + 1]), at) for s in per_shard]
            # Index keys need nothing: pools completed by rejected drafts are stale rows, rewritten on the redo.

    def decode(self, reqs: Sequence[RequestState], tokens: torch.Tensor) -> StepOutput:
        """One token [R] per request, committed."""
        out, pending = self._forward(reqs, tokens.reshape(-1, 1), prefill=False)
        self.commit(reqs, pending, [1] * len(reqs))
        return out

    def _forward(self, reqs, tokens: torch.Tensor, prefill: bool):
        cfg, w0 = self.cfg, self.shards[0]
        R, Q = tokens.shape
        x = F.embedding(tokens.reshape(-1), w0.embed)  # [N = R*Q, hidden]
        streams = hc_expand(x, cfg.hc_mult)  # [N, n, hidden]
        aux, attended, pending, selection, margin = {}, {}, {}, None, float("inf")
        for i, lw in enumerate(w0.layers):
            post, comb, h = hc_pre(lw.attn_hc, streams)
            h = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            if lw.kda is not None:
                out = self._kda(i, h.view(R, Q, -1), reqs, prefill, pending)
            else:
                if lw.indexer is not None:  # a full layer selects; the shared ones after it reuse the selection
                    selection, m = self._select(i, h, reqs, Q)
                    attended[i], margin = selection, min(margin, m)
                out = self._mla(i, h, reqs, Q, selection)
            streams = hc_post(out, streams, post, comb)
            post, comb, h = hc_pre(lw.ffn_hc, streams)
            h = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
            if lw.moe is not None:
                out = sum(moe(s.layers[i].moe, h, cfg.swiglu_limit) for s in self.shards)
            else:
                out = sum(mlp(s.layers[i].mlp, h, cfg.swiglu_limit) for s in self.shards)
            streams = hc_post(out, streams, post, comb)
            if i in self.aux_layer_ids:
                aux[i] = hc_contract(streams)
        hidden = rms_norm(hc_contract(streams), w0.norm, cfg.rms_norm_eps)
        logits = None if w0.lm_head is None else F.linear(hidden, w0.lm_head).view(R, Q, -1)
        feats = torch.cat([aux[i] for i in self.aux_layer_ids], -1).view(R, Q, -1) if aux else None
        return StepOutput(logits, hidden.view(R, Q, -1), feats, attended, margin), Pending(pending, Q)

    def _kda(self, i: int, h: torch.Tensor, reqs, prefill: bool, pending: dict) -> torch.Tensor:
        """KDA layer i over h [R, Q, hidden]: the sum of the shards' partial outputs, flat [N, hidden]."""
        out, per_shard = 0, []
        for s, shard in enumerate(self.shards):
            w = shard.layers[i].kda
            states = [req.kda[i][s] if i in req.kda else kda_zero_state(w, 1, h.dtype) for req in reqs]
            state = KdaState(torch.cat([st.conv for st in states]), torch.cat([st.recurrent for st in states]))
            o, new = (kda_prefill(w, h, state, self.kda_chunk) if prefill else kda_verify(w, h, state))
            per_shard.append(new)
            out = out + o.reshape(-1, o.shape[-1])
        if not prefill:
            pending[i] = per_shard
            return out
        for r, req in enumerate(reqs):
            req.kda[i] = [KdaState(st.conv[r:r + 1], st.recurrent[r:r + 1]) for st in per_shard]
        return out

    def _mla(self, i: int, h: torch.Tensor, reqs, Q: int, selection: list[torch.Tensor]) -> torch.Tensor:
        """MLA layer i over flat h [N, hidden] attending the selected keys [Q, S] of each request; the summed
        partials [N, hidden]."""
        m0 = self.shards[0].layers[i].mla
        q_resid = mla_q_resid(m0, h)  # replicated
        new_latent = mla_latent(m0, h).view(len(reqs), Q, -1)
        for r, req in enumerate(reqs):
            old = req.latent.get(i, new_latent.new_zeros(0, new_latent.shape[-1]))
            req.latent[i] = torch.cat([old[: req.length], new_latent[r]])
        S = max(req.latent[i].shape[0] for req in reqs)
        latents = torch.stack([F.pad(req.latent[i], (0, 0, 0, S - req.latent[i].shape[0])) for req in reqs])
        mask = torch.stack([F.pad(m, (0, S - m.shape[1])) for m in selection])  # [R, Q, S]
        out = 0
        for shard in self.shards:
            w = shard.layers[i].mla
            q_lat = mla_absorbed_query(w, q_resid).view(len(reqs), Q, w.num_heads, -1)
            o_lat, _ = latent_attention(q_lat, latents, mask, w.scale, w.latent_dim)
            out = out + mla_output(w, o_lat.reshape(-1, w.num_heads, o_lat.shape[-1]), h.dtype)
        return out

    def _select(self, i: int, h, reqs, Q: int) -> tuple[list[torch.Tensor], float]:
        """Full indexer of layer i: append the new index keys; each request's attended keys [Q, S] and the
        smallest selection margin."""
        lw = self.shards[0].layers[i]
        w = lw.indexer
        q, head_w = index_query(w, h, mla_q_resid(lw.mla, h))
        k, gate = index_key(w, h)
        masks, margin = [], float("inf")
        for r, req in enumerate(reqs):
            rows, start = slice(r * Q, (r + 1) * Q), req.length
            cache = req.index[i] if i in req.index else new_index_cache(w, self.ring, k.dtype)
            cache = req.index[i] = append_index_keys(cache, start, k[rows], gate[rows], w.compress_ape)
            S = start + Q
            tokens, _, m = select_tokens(w, q[rows], head_w[rows], cache.pooled[: S // w.kpool], torch.arange(start, S))
            masks.append(selection_mask(tokens, torch.arange(S), S))
            margin = min(margin, m.min().item())
        return masks, margin
