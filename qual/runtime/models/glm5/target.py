"""GLM-5.3-Flash as a paged, TP- and DCP-sharded target of the runtime (docs/glm5.md).

Cache groups on one rank:
  latent      one normalised MLA latent per token, every indexed layer; sequence-sharded under DCP
  index       one pooled DSA index key per complete pool, every full indexer layer; sharded by pool
  index_tail  the last `ring` positions' raw index key + gate score per request (replicated): the owner of a
              pool compresses it from here when the pool's last token arrives, whichever step brought the rest
  kda         each linear layer's conv + recurrent state per request (replicated), kept for every position of
              the last step so that a verify commits the state after its last accepted token
Selection under DCP: every rank scores the pools it holds and takes its local top-k; `exact` merges all ranks'
candidates into the global top-k (bit-equal to DCP 1: the same total order decides); `union` attends the union
of the local top-ks (a superset: cheaper, but another set). Each rank attends the selected tokens it holds and
the partial results merge by their LSE.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qual.errors import QualError
from qual.options import REPLICATED, SHARDED
from qual.runtime.config import ParallelConfig
from qual.runtime.dcp_attention import dcp_attention
from qual.runtime.kv_cache import KVCacheGroup, KVCacheSpec
from qual.runtime.models.base import ModelOptions, TargetMeta
from qual.runtime.models.glm5.common import acc_dtype
from qual.runtime.models.glm5.config import INDEXED, LINEAR, Glm5Config, parse_glm5_config
from qual.runtime.models.glm5.dsa import index_key, index_query, pool_keys, pool_scores, score_scale, tail_ring_size
from qual.runtime.models.glm5.kda import KdaState, kda_prefill, kda_verify, kda_zero_state
from qual.runtime.models.glm5.mhc import block_input, block_output, contract, hc_expand
from qual.runtime.models.glm5.mla import latent_inputs, mla_absorbed_query, mla_latent, mla_output, mla_q_resid
from qual.runtime.models.glm5.moe import mlp, moe
from qual.runtime.models.glm5.numerics import numerics_of
from qual.runtime.models.glm5.topk import local_topk, merge_topk, union_topk
from qual.runtime.models.glm5.weights import load_glm5_weights
from qual.runtime.models.layers import Rope, rms_norm
from qual.runtime.paged import pad_queries, unpad

MODEL_TYPES = ("glm5_next_text", "glm5_next")
LATENT, INDEX, TAIL, KDA = "latent", "index", "index_tail", "kda"


@dataclass(frozen=True)
class _Layers:
    """Which layers sit in which cache group, and each one's index inside its group."""

    indexed: tuple[int, ...]
    full: tuple[int, ...]  # indexed layers that run the indexer
    linear: tuple[int, ...]

    @classmethod
    def of(cls, cfg: Glm5Config) -> "_Layers":
        indexed = tuple(i for i, t in enumerate(cfg.layer_types) if t == INDEXED)
        return cls(indexed, tuple(i for i in indexed if cfg.indexer_types[i] == "full"),
                   tuple(i for i, t in enumerate(cfg.layer_types) if t == LINEAR))


class Glm5Target:
    """This rank's shard of a GLM-5.3-Flash text stack (the vision tower is not loaded)."""

    sparse_attention = True  # DSA: ModelOptions.dsa_topk decides the top-k under DCP
    vllm_numerics = True  # ModelOptions.numerics: as written, or as vLLM computes it (numerics.py)

    @staticmethod
    def notes(cfg: Glm5Config, numerics: str) -> list[str]:
        """A config default the run's numerics compute otherwise than vLLM (or than transformers) does."""
        has_linear = LINEAR in cfg.layer_types
        if not has_linear or cfg.linear_lower_bound is not None:
            return []
        if numerics_of(numerics).safe_gate:
            return [f"{cfg.source}: linear_lower_bound null: numerics {numerics} runs vLLM's KDA safe gate with its "
                    "default lower bound -5.0 (transformers runs the softplus gate)"]
        return [f"{cfg.source}: linear_lower_bound null: numerics {numerics} runs transformers' softplus KDA gate; "
                "vLLM runs its safe gate with lower bound -5.0 (--numerics vllm computes that)"]

    @staticmethod
    def parse_config(raw: dict, path: Path) -> Glm5Config:
        return parse_glm5_config(raw, str(Path(path) / "config.json"))

    @staticmethod
    def check_parallel(cfg: Glm5Config, parallel: ParallelConfig) -> None:
        """Heads split across TP; the one MLA latent is on every TP rank, so DCP may go up to TP (tp % dcp only)."""
        for key in ("num_attention_heads", "linear_num_heads", "intermediate_size", "moe_intermediate_size"):
            if getattr(cfg, key) % parallel.tp:
                raise QualError(f"{cfg.source}: {key}={getattr(cfg, key)} is not divisible by tp={parallel.tp}")

    @staticmethod
    def cache_groups(cfg: Glm5Config, comm, dtype_bytes: int, num_speculative_tokens: int) -> list[KVCacheGroup]:
        lay = _Layers.of(cfg)
        names = lambda ids: tuple(f"target.{i}" for i in ids)  # noqa: E731
        acc_bytes = max(dtype_bytes, 4)
        H, D, C = cfg.linear_num_heads // comm.tp_size, cfg.linear_head_dim, 3 * cfg.linear_num_heads // comm.tp_size
        state = (1 + num_speculative_tokens) * (C * D * (cfg.linear_conv_kernel_dim - 1) * dtype_bytes + H * D * D * acc_bytes)
        groups = [
            KVCacheGroup(LATENT, KVCacheSpec("latent", SHARDED, dtype_bytes, head_dim=cfg.kv_lora_rank + cfg.mla_rope_dim),
                         names(lay.indexed)),
            KVCacheGroup(INDEX, KVCacheSpec("pooled", SHARDED, dtype_bytes, head_dim=cfg.index_head_dim, pool=cfg.index_kpool),
                         names(lay.full)),
            KVCacheGroup(TAIL, KVCacheSpec("ring", REPLICATED, dtype_bytes, head_dim=2 * cfg.index_head_dim,
                                           ring=tail_ring_size(cfg.index_kpool, num_speculative_tokens)), names(lay.full)),
            KVCacheGroup(KDA, KVCacheSpec("state", REPLICATED, dtype_bytes, state_bytes=state), names(lay.linear)),
        ]
        return [g for g in groups if g.layers]

    def __init__(self, path: str | Path, cfg: Glm5Config, comm, dtype: torch.dtype, aux_layer_ids: tuple[int, ...],
                 backend, options: ModelOptions):
        if backend.parts:
            raise QualError(f"backend {backend.name}: the GLM-5 target runs the reference backend only")
        self.cfg = self.config = cfg
        self.comm, self.dtype, self.dsa_topk = comm, dtype, options.dsa_topk
        self.numerics = numerics_of(options.numerics)
        self.w = load_glm5_weights(path, comm.tp_rank, comm.tp_size, dtype, comm.device, self.numerics)
        if self.w.lm_head is None:
            raise QualError(f"{path}: a bare text model (no lm_head) cannot be a target")
        self.embed, self.lm_head = self.w.embed, self.w.lm_head
        self.lay = _Layers.of(cfg)
        # Each group numbers its own layers: the latent group holds every indexed layer, the index and tail groups
        # only the full indexer layers (in the same order), so one layer has two slots where shared layers exist.
        self.latent_slot = {i: n for n, i in enumerate(self.lay.indexed)}
        self.index_slot = {i: n for n, i in enumerate(self.lay.full)}
        self.kda_slot = {i: self.lay.linear.index(i) for i in self.lay.linear}
        self.aux_layer_ids = tuple(aux_layer_ids)
        R = cfg.qk_rope_head_dim
        # vLLM's rotations: MLA's q_pe and k_pe as interleaved pairs; the indexer's first R dims as it is told
        self.mla_rope = Rope(R, cfg.rope_theta, comm.device, dtype, neox=False) if cfg.mla_rope else None
        self.index_rope = Rope(R, cfg.rope_theta, comm.device, dtype, neox=not cfg.indexer_rope_interleave) if R else None
        self.linear = F.linear
        self.acc = acc_dtype(dtype)

    def state_parts(self, group: str) -> dict:
        """The shapes and dtypes of a state group's parts (the runner allocates them)."""
        if group != KDA:
            raise ValueError(f"{group} is not a state group")
        w = self.w.layers[self.lay.linear[0]].kda
        return {"conv": ((w.conv.shape[0], w.conv.shape[1] - 1), self.dtype),
                "recurrent": ((w.num_heads, w.head_dim, w.head_dim), w.acc)}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: TargetMeta, stores: dict):
        """tokens/positions [T] -> (final-normed hidden [T, hidden], aux features [T, n*hidden] or None)."""
        cfg, comm = self.cfg, self.comm
        for rope in (self.mla_rope, self.index_rope):
            if rope is not None:
                rope.reset()
        x = F.embedding(tokens, self.embed)
        residual = hc_expand(x, cfg.hc_mult) if cfg.mhc else x  # [T, n, hidden] streams, or [T, hidden]
        q_pos = pad_queries(positions[:, None], meta.q_index, meta.dense)[..., 0]  # [R, Q]
        aux, attend = {}, None
        for i, lw in enumerate(self.w.layers):
            h, mix = block_input(lw.attn_hc, residual)
            h = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            if lw.kda is not None:
                out = self._kda(i, lw.kda, h, meta, stores[KDA])
            else:
                q_resid = mla_q_resid(lw.mla, h)
                if lw.indexer is not None:  # a full layer selects; a shared one right after it reuses the selection
                    attend = self._select(i, lw.indexer, h, q_resid, positions, q_pos, meta, stores)
                out = self._mla(i, lw.mla, h, q_resid, positions, attend, meta, stores[LATENT])
            residual = block_output(comm.all_reduce_tp(out), residual, mix)
            h, mix = block_input(lw.ffn_hc, residual)
            h = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
            out = moe(lw.moe, h, cfg.swiglu_limit) if lw.moe is not None else mlp(lw.mlp, h, cfg.swiglu_limit)
            residual = block_output(comm.all_reduce_tp(out), residual, mix)
            if i in self.aux_layer_ids:
                aux[i] = contract(residual)  # vLLM's aux hidden state i + 1: layer i's completed streams
        features = torch.cat([aux[i] for i in self.aux_layer_ids], dim=-1) if aux else None
        return rms_norm(contract(residual), self.w.norm, cfg.rms_norm_eps), features

    # -- layers ------------------------------------------------------------------------------------------

    def _kda(self, i: int, w, h: torch.Tensor, meta: TargetMeta, store) -> torch.Tensor:
        """KDA over the step's tokens: a prefill starts each prompt from the empty state; a decode / verify step
        starts from each request's committed state and keeps the state after every position."""
        view, j = meta.views[KDA], self.kda_slot[i]
        if meta.dense:  # [P, Q] tokens: decode or verify
            P, Q = meta.q_index.shape
            start = store.read(j, view.slots, view.commit)
            out, states = kda_verify(w, h.view(P, Q, -1), KdaState(start["conv"], start["recurrent"]))
            store.write(j, view.slots, {"conv": states.conv, "recurrent": states.recurrent})
            return out.reshape(P * Q, -1)
        out = h.new_empty(h.shape[0], self.cfg.hidden_size)
        for r in range(meta.q_index.shape[0]):  # a prefill: prompts of different lengths, one at a time
            rows = meta.q_index[r][meta.q_index[r] >= 0]
            o, state = kda_prefill(w, h[rows][None], kda_zero_state(w, 1, h.dtype, h.device))
            out[rows] = o[0]
            store.write(j, view.slots[r:r + 1], {"conv": state.conv[:, None], "recurrent": state.recurrent[:, None]})
        return out

    def _mla(self, i: int, w, h, q_resid, positions, attend, meta: TargetMeta, store) -> torch.Tensor:
        """MLA over the local latent shard, DCP-merged; this rank's row-parallel partial [T, hidden]."""
        comm, view, j = self.comm, meta.views[LATENT], self.latent_slot[i]
        store.write(j, view.write_slots, mla_latent(w, h, self.mla_rope, positions))
        q_lat = mla_absorbed_query(w, q_resid, self.mla_rope, positions)  # [T, Hl, L (+ R)]
        T, Hl, L = q_lat.shape
        # DCP step 1: gather the group's query heads (heads ordered by DCP rank).
        qg = comm.all_gather_dcp(q_lat).permute(1, 0, 2, 3).reshape(T, comm.dcp_size * Hl, L)
        latents = store.gather(j, view.keys.slots)  # [R, S, L (+ R)]
        # Steps 2 and 3: one latent "KV head" serves every query head, in at least float32 (latent_inputs)
        q, k = latent_inputs(pad_queries(qg, meta.q_index, meta.dense), latents)
        out = dcp_attention(comm, q, k, k[..., :w.latent_dim], view.mask & attend, w.scale, Hl)
        return mla_output(w, unpad(out, meta.q_index, T, meta.dense), h.dtype)

    def _select(self, i: int, w, h, q_resid, positions, q_pos, meta: TargetMeta, stores) -> torch.Tensor:
        """DSA for a full layer: store the new index keys, compress the pools they complete, score the pools this
        rank holds, select (exact or union over the DCP group) and return which local latent keys each query
        attends, [R, Q, S]."""
        comm, P, j = self.comm, w.kpool, self.index_slot[i]
        q, head_w = index_query(w, h, q_resid, self.index_rope, positions)  # [T, Hi, Di], [T, Hi]
        k, gate = index_key(w, h, self.index_rope, positions)  # [T, Di] each
        tail, pooled = meta.views[TAIL], meta.views[INDEX]
        ring, pstore = stores[TAIL], stores[INDEX]
        ring.write(j, tail.write_slots, torch.cat([k, gate], dim=-1))
        pstore.write(j, pooled.write_slots, self._pool_keys(w, k, gate, positions, meta, ring, j))
        # Score the pools this rank holds; positions of the pooled view are global pool ids.
        held = pstore.gather(j, pooled.keys.slots).to(self.acc)  # [R, S_p, Di]
        qp = pad_queries(q, meta.q_index, meta.dense)  # [R, Q, Hi, Di]
        hw = pad_queries(head_w, meta.q_index, meta.dense)  # [R, Q, Hi]
        scores = pool_scores(qp, hw, held.unsqueeze(1), score_scale(w))  # [R, Q, S_p], the same bits at every DCP size
        R, Q, Sp = scores.shape
        ids = pooled.ids.expand(R * Q, Sp)
        top_s, top_i = local_topk(scores.reshape(R * Q, Sp), ids, pooled.mask.reshape(R * Q, Sp), w.select_pools)
        if comm.dcp_size > 1:
            gathered_i = comm.all_gather_dcp(top_i)  # [N, RQ, k]
            if self.dsa_topk == "exact":
                gathered_s = comm.all_gather_dcp(top_s)
                cat = lambda t: t.permute(1, 0, 2).reshape(R * Q, -1)  # noqa: E731
                _, top_i = merge_topk(cat(gathered_s), cat(gathered_i), w.select_pools)
            else:
                top_i = union_topk(gathered_i)
        return self._attended(top_i.view(R, Q, -1), q_pos, meta.views[LATENT], P, w.select_tail)

    def _pool_keys(self, w, k, gate, positions, meta: TargetMeta, ring, j) -> torch.Tensor:
        """The pooled key each new token would complete, [T, Di] (only completing tokens' are stored): the pool's
        earlier positions come from this step where it has them, else from the tail ring."""
        P, Di = w.kpool, w.head_dim
        tail = meta.views[TAIL]
        T = positions.shape[0]
        rows = torch.arange(meta.q_index.shape[0], device=positions.device)[:, None].expand_as(meta.q_index)
        # each token's request row; padding (-1) scatters to a sink slot past T: no boolean indexing, no host sync
        sink = torch.where(meta.q_index >= 0, meta.q_index, T).reshape(-1)
        row_of = torch.zeros(T + 1, dtype=torch.long, device=positions.device).scatter_(0, sink, rows.reshape(-1))[:T]
        first = positions[meta.q_index[:, 0].clamp(min=0)]  # [R] first new position of each request
        window = positions[:, None] - (P - 1) + torch.arange(P, device=positions.device)  # [T, P] the pool's positions
        from_step = window >= first[row_of][:, None]
        flat = (torch.arange(T, device=positions.device)[:, None] - (positions[:, None] - window)).clamp(min=0)
        ring_slots = tail.base[row_of][:, None] + window % tail.ring
        held = ring.gather(j, ring_slots)  # [T, P, 2Di]
        keys = torch.where(from_step[..., None], k[flat], held[..., :Di].to(k.dtype))
        gates = torch.where(from_step[..., None], gate[flat], held[..., Di:].to(gate.dtype))
        return pool_keys(w, keys, gates)

    def _attended(self, pools: torch.Tensor, q_pos: torch.Tensor, view, P: int, tail: bool) -> torch.Tensor:
        """[R, Q, S] over the local latent keys: the key's pool is selected, or it is in the query's own
        incomplete pool (the always-select-tail rule)."""
        key_pos = view.key_positions  # [R, S] global positions (device)
        key_pool = key_pos // P
        hit = (key_pool[:, None, :, None] == pools[:, :, None, :]) & (pools[:, :, None, :] >= 0)
        attend = hit.any(-1)
        if tail:
            start = (q_pos + 1) // P * P
            attend |= (key_pos[:, None, :] >= start[:, :, None]) & (key_pos[:, None, :] <= q_pos[:, :, None])
        return attend
