"""Qwen3 target: TP-sharded heads, DCP attention with LSE combine, aux hidden states for DFlash."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from qual.checkpoints.io import load_weights, require
from qual.checkpoints.qwen3 import MODEL_TYPE, Qwen3Config, check_target_keys
from qual.errors import QualError
from qual.options import SHARDED
from qual.runtime.config import ParallelConfig
from qual.runtime.dcp_attention import dcp_attention, dcp_combine
from qual.runtime.kv_cache import KVCacheGroup, KVCacheSpec
from qual.runtime.models.base import ModelOptions, TargetMeta
from qual.runtime.models.layers import HeadLayout, Rope, load_layers, mlp, project_qkv, rms_norm
from qual.runtime.paged import KVStore, pad_queries, unpad
from qual.runtime.parallel import Comm

GROUP = "target"  # one cache group: every layer's K/V, sequence-sharded under DCP


class Qwen3Target:
    """This rank's shard of a Qwen3 target."""

    sparse_attention = False  # dense attention: no top-k to choose
    serves_fused_layer = True  # the backend parts fused-layer and gluon-layer run this model's decode layers
    vllm_numerics = False  # one form: what vLLM computes differently for Qwen3 is not modelled

    @staticmethod
    def notes(cfg, numerics: str) -> list[str]:
        return []

    @staticmethod
    def parse_config(raw: dict, path: Path) -> Qwen3Config:
        if raw.get("model_type") != MODEL_TYPE:
            raise QualError(f"{path / 'config.json'}: model_type must be {MODEL_TYPE!r} (got {raw.get('model_type')!r})")
        check_target_keys(raw, path)  # a quantized or otherwise unimplemented target refused here, at plan time
        cfg = Qwen3Config.from_json(raw, path)
        if cfg.attention_bias:  # the target's projections have no bias terms here
            raise QualError(f"{path / 'config.json'}: attention_bias true is not supported for a Qwen3 target")
        return cfg

    @staticmethod
    def check_parallel(cfg: Qwen3Config, parallel: ParallelConfig) -> None:
        parallel.check_model(cfg.num_attention_heads, cfg.num_key_value_heads, "target")

    @staticmethod
    def cache_groups(cfg: Qwen3Config, comm: Comm, dtype_bytes: int, num_speculative_tokens: int = 0) -> list[KVCacheGroup]:
        lay = HeadLayout.for_rank(cfg, comm)
        spec = KVCacheSpec("gqa", replication=SHARDED, dtype_bytes=dtype_bytes, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim)
        return [KVCacheGroup(GROUP, spec, tuple(f"target.{i}" for i in range(cfg.num_hidden_layers)))]

    def __init__(self, path: str | Path, cfg: Qwen3Config, comm: Comm, dtype: torch.dtype, aux_layer_ids: tuple[int, ...],
                 backend, options: ModelOptions):
        self.cfg, self.config = cfg, cfg
        dev = comm.device
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
        self.stacked = load_layers(weights, [f"model.layers.{i}." for i in range(cfg.num_hidden_layers)], cfg,
                                   self.layout, comm, path, cast)
        self.layers = [self.stacked.layer(i) for i in range(cfg.num_hidden_layers)]
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, dev, dtype)
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.scale = cfg.head_dim**-0.5
        self.linear = backend.linear()  # the projections' GEMM
        self.paged_attention = backend.paged_attention()  # None: gather the keys, then attention_with_lse
        self.fused = None  # set by the fused backend: one kernel for a one-token decode step
        # fused-layer / gluon-layer: decode and verify steps of <= 16 rows through four products a layer (None: the
        # per-layer path)
        self.layer_products = (backend.layer_products(cfg.hidden_size, cfg.intermediate_size, self.layout,
                                                      cfg.rms_norm_eps, dev) if backend.layer_part else None)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: TargetMeta, stores: dict[str, KVStore]):
        """tokens/positions [T] -> (final-normed hidden [T, hidden], aux features [T, n*hidden] or None)."""
        self.rope.reset()
        store = stores[GROUP]
        if self.fused is not None and self.fused.applies(tokens, meta):
            x = self.fused(tokens, positions, meta.views[GROUP], store).to(self.dtype)
            return rms_norm(x, self.norm, self.cfg.rms_norm_eps), None
        x = F.embedding(tokens, self.embed)
        aux = []
        products = self.layer_products
        fused_layers = products is not None and products.applies(tokens.numel(), meta.prefill)
        x_ln = products.enter(x, self.layers[0].input_norm) if fused_layers else None
        for i, layer in enumerate(self.layers):
            if fused_layers:
                x, x_ln = self._fused_layer(i, x, x_ln, positions, meta, store)
            else:
                h = rms_norm(x, layer.input_norm, self.cfg.rms_norm_eps)
                x = x + self._attention(i, h, positions, meta, store)
                x = x + mlp(rms_norm(x, layer.post_norm, self.cfg.rms_norm_eps), layer.mlp, self.comm, self.linear)
            if i in self.aux_layer_ids:
                aux.append(x)
        features = torch.cat(aux, dim=-1) if aux else None  # in layer order: aux_layer_ids ascend
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps), features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden, self.lm_head)  # the projections' GEMM: a decode step's largest product

    def _attention(self, i: int, h, positions, meta: TargetMeta, store: KVStore) -> torch.Tensor:
        a, lay = self.layers[i].attn, self.layout
        q, k, v = project_qkv(h, a, lay, self.cfg.rms_norm_eps, self.rope, positions, self.linear)
        store.write(i, meta.views[GROUP].write_slots, k, v)
        return self.comm.all_reduce_tp(self.linear(self._attend(i, q, meta, store), a.o))

    def _fused_layer(self, i: int, x, x_ln, positions, meta: TargetMeta, store: KVStore):
        """The residual after layer i through the fused-layer or gluon-layer products (tp 1: the residual is added
        inside them), and what the next layer's products take beside it (gluon-layer: x * its input norm; None)."""
        layer, products, lay = self.layers[i], self.layer_products, self.layout
        q = products.qkv(x, x_ln, layer.input_norm, layer.attn, positions, self.rope.inv_freq,
                         meta.views[GROUP].write_slots, store.k[i], store.v[i])
        attended = self._attend(i, q.view(x.shape[0], lay.num_heads, lay.head_dim), meta, store)
        x, x_ln = products.o(attended, layer.attn.o, x, layer.post_norm)
        next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
        return products.mlp(x, x_ln, layer.post_norm, layer.mlp, next_norm)

    def _attend(self, i: int, q, meta: TargetMeta, store: KVStore) -> torch.Tensor:
        """Attention of this rank's roped queries q [T, heads, D] over layer i's keys (written): [T, heads * D]."""
        comm = self.comm
        view = meta.views[GROUP]
        T, Hl, D = q.shape
        # DCP step 1: gather the group's query heads (heads ordered by DCP rank).
        qg = comm.all_gather_dcp(q).permute(1, 0, 2, 3).reshape(T, comm.dcp_size * Hl, D)
        # Step 2: attend over the local KV shard only, keeping the LSE.
        q_pad = pad_queries(qg, meta.q_index, meta.dense)
        if self.paged_attention is not None and meta.dense and not meta.prefill:  # decode: one kernel reads the paged store in place
            out, lse = self.paged_attention(q_pad, store.k[i], store.v[i], view.keys.slots, view.mask, self.scale,
                                            view.keys.lengths)
            if comm.dcp_size > 1:  # step 3: merge the partials, keep this rank's heads
                out = dcp_combine(comm, out, lse, Hl)
        else:  # steps 2 and 3 by the run's merge path
            kc, vc = store.gather(i, view.keys)
            out = dcp_attention(comm, q_pad, kc, vc, view.mask, self.scale, Hl, fused=meta.prefill)
        return unpad(out, meta.q_index, T, meta.dense).reshape(T, Hl * D)
