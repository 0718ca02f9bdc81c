"""Qwen3 target: TP-sharded heads, DCP attention with LSE combine, aux hidden states for DFlash."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qual.runtime.attention import attention_with_lse, combine_lse, global_lse, rescale_to_global
from qual.runtime.checkpoint import Qwen3Config, load_target_config, load_weights, require
from qual.runtime.models.layers import HeadLayout, Rope, load_layer, mlp, project_qkv, rms_norm
from qual.runtime.paged import KeyView, KVStore, pad_queries, unpad
from qual.runtime.parallel import Comm


@dataclass
class TargetMeta:
    """Attention metadata of one target forward on this rank."""

    write_slots: torch.Tensor  # [T] slot of each new token here; not stored here = the store's trash slot
    keys: KeyView  # local keys per request (new tokens included)
    q_index: torch.Tensor  # [R, Q] flat token index, -1 = padding
    mask: torch.Tensor  # [R, Q, S] causal by global position
    dense: bool = False  # every request has exactly Q query tokens (decode): no padding to strip


def causal_mask(q_positions: torch.Tensor, q_index: torch.Tensor, keys: KeyView) -> torch.Tensor:
    """[R, Q, S]: key visible if stored here and not after the query."""
    return keys.valid[:, None, :] & (keys.positions[:, None, :] <= q_positions[:, :, None]) & (q_index >= 0)[:, :, None]


class Qwen3Target:
    """This rank's shard of a Qwen3 target."""

    def __init__(self, path: str | Path, comm: Comm, dtype: torch.dtype, aux_layer_ids: tuple[int, ...] = (),
                 linear=F.linear, paged_attention=None):
        self.cfg: Qwen3Config = load_target_config(path)
        cfg, dev = self.cfg, comm.device
        weights = load_weights(path)
        cast = lambda t: t.to(device=dev, dtype=dtype)  # noqa: E731
        self.comm, self.dtype = comm, dtype
        self.layout = HeadLayout.for_rank(cfg, comm)
        self.embed = cast(require(weights, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), path))
        if cfg.tie_word_embeddings:  # one device copy (a second would cost vocab x hidden of HBM)
            self.lm_head = self.embed
        else:
            self.lm_head = cast(require(weights, "lm_head.weight", (cfg.vocab_size, cfg.hidden_size), path))
        self.norm = cast(require(weights, "model.norm.weight", (cfg.hidden_size,), path))
        self.layers = [
            load_layer(weights, f"model.layers.{i}.", cfg, self.layout, comm, path, cast) for i in range(cfg.num_hidden_layers)
        ]
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, dev, dtype)
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.scale = cfg.head_dim**-0.5
        self.linear = linear  # the projections' GEMM (F.linear, or the Triton split-K kernel for decode)
        self.paged_attention = paged_attention  # None: gather the keys, then attention_with_lse
        self.fused = None  # a FusedDecode (qual/runtime/fused_decode.py) for one-token decode steps

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: TargetMeta, store: KVStore):
        """tokens/positions [T] -> (final-normed hidden [T, hidden], aux features [T, n*hidden] or None)."""
        self.rope.reset()
        if self.fused is not None and self.fused.applies(tokens, meta):
            x = self.fused(tokens, positions, meta, store).to(self.dtype)
            return rms_norm(x, self.norm, self.cfg.rms_norm_eps), None
        x = F.embedding(tokens, self.embed)
        aux = []
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.cfg.rms_norm_eps)
            x = x + self._attention(i, h, positions, meta, store)
            x = x + mlp(rms_norm(x, layer.post_norm, self.cfg.rms_norm_eps), layer.mlp, self.comm, self.linear)
            if i in self.aux_layer_ids:
                aux.append(x)
        features = torch.cat([aux[self.aux_layer_ids.index(i)] for i in self.aux_layer_ids], dim=-1) if aux else None
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps), features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)

    def _dcp_combine(self, out: torch.Tensor, lse: torch.Tensor, Hl: int, D: int) -> torch.Tensor:
        """Step 3: merge the DCP group's partial results and return this rank's own heads [R, Q, Hl, D]."""
        comm, N = self.comm, self.comm.dcp_size
        R, Q = out.shape[:2]
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

    def _attention(self, i: int, h, positions, meta: TargetMeta, store: KVStore) -> torch.Tensor:
        a, lay, comm = self.layers[i].attn, self.layout, self.comm
        q, k, v = project_qkv(h, a, lay, self.cfg.rms_norm_eps, self.rope, positions, self.linear)
        store.write(i, meta.write_slots, k, v)
        T, Hl, D = q.shape
        # DCP step 1: gather the group's query heads (heads ordered by DCP rank).
        qg = comm.all_gather_dcp(q).permute(1, 0, 2, 3).reshape(T, comm.dcp_size * Hl, D)
        # Step 2: attend over the local KV shard only, keeping the LSE.
        q_pad = pad_queries(qg, meta.q_index, meta.dense)
        if self.paged_attention is not None and meta.dense:  # decode: one kernel reads the paged store in place
            out, lse = self.paged_attention(q_pad, store.k[i], store.v[i], meta.keys.slots, meta.mask, self.scale,
                                            meta.keys.lengths)
        else:
            kc, vc = store.gather(i, meta.keys)
            out, lse = attention_with_lse(q_pad, kc, vc, meta.mask, self.scale)
        if comm.dcp_size > 1:
            out = self._dcp_combine(out, lse, Hl, D)
        flat = unpad(out, meta.q_index, T, meta.dense).reshape(T, Hl * D)
        return comm.all_reduce_tp(self.linear(flat, a.o))
