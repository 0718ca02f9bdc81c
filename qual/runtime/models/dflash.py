"""DFlash and DFlash2 drafters: context K/V from target aux hidden states, one forward drafts a whole block
(docs/dflash.md). DFlash2 adds grouped causal convolutions around each layer's attention and MLP, and a candidate
head whose edge scores spec_decode walks."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from qual.checkpoints.dflash import DFlashConfig, check_weight_names, weight_shapes
from qual.checkpoints.io import load_weights, require
from qual.errors import QualError
from qual.runtime.attention import attention_with_lse
from qual.runtime.config import ParallelConfig
from qual.runtime.kv_cache import KVCacheGroup, KVCacheSpec
from qual.runtime.models.base import DraftMeta, TargetModel
from qual.runtime.models.layers import HeadLayout, Rope, load_layers, mlp, project_kv, project_qkv, rms_norm
from qual.runtime.paged import KVStore
from qual.runtime.parallel import Comm
from qual.userfiles import load_torch

MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's override of the mask token's embedding
MAX_MASK_EMBEDDING_BYTES = 1 << 26  # one embedding row (hidden_size values) and a small dict around it


def group_name(sliding: bool) -> str:
    """Draft layers share a cache group per attention kind."""
    return "draft_sliding" if sliding else "draft"


class DFlashDrafter:
    """This rank's shard of a DFlash drafter; embedding and LM head are the target's unless the checkpoint has its own."""

    @staticmethod
    def parse_config(raw: dict, path: Path) -> DFlashConfig:
        return DFlashConfig.from_json(raw, path)

    @staticmethod
    def check_parallel(cfg: DFlashConfig, parallel: ParallelConfig) -> None:
        parallel.check_model(cfg.layers.num_attention_heads, cfg.layers.num_key_value_heads, "drafter")

    @staticmethod
    def check_target(cfg: DFlashConfig, tcfg, path) -> None:
        """The drafter reads the target's hidden states and shares its embedding and LM head."""
        lcfg = cfg.layers
        if lcfg.hidden_size != tcfg.hidden_size or lcfg.vocab_size != tcfg.vocab_size:
            raise QualError(f"drafter {path}: hidden_size/vocab_size {lcfg.hidden_size}/{lcfg.vocab_size} must match "
                            f"the target's ({tcfg.hidden_size}/{tcfg.vocab_size})")
        if cfg.num_target_layers != tcfg.num_hidden_layers:
            raise QualError(f"drafter {path}: num_target_layers={cfg.num_target_layers} but the target has "
                            f"{tcfg.num_hidden_layers} layers")

    @staticmethod
    def cache_groups(cfg: DFlashConfig, comm: Comm, dtype_bytes: int, draft_kv: str,
                     draft_window: int | None) -> list[KVCacheGroup]:
        """Draft layers grouped by attention kind; replicated (the fix) or sharded like the target (legacy), sliding
        groups included. Layers of one group share causality (the merge refuses otherwise)."""
        dl = HeadLayout.for_rank(cfg.layers, comm)
        by_name: dict[str, KVCacheGroup] = {}
        for i in range(cfg.layers.num_hidden_layers):
            sliding = cfg.layer_sliding(i)
            spec = KVCacheSpec("gqa", replication=draft_kv, dtype_bytes=dtype_bytes, num_kv_heads=dl.num_kv_heads,
                               head_dim=dl.head_dim, window=cfg.sliding_window if sliding else draft_window,
                               attention="sliding" if sliding else "full", causal=cfg.layer_causal(i))
            g = KVCacheGroup(group_name(sliding), spec, (f"draft.{i}",))
            by_name[g.name] = by_name[g.name].merge(g) if g.name in by_name else g
        return list(by_name.values())

    def __init__(self, path: str | Path, cfg: DFlashConfig, comm: Comm, dtype: torch.dtype, target: TargetModel):
        self.cfg = self.config = cfg
        self.check_target(cfg, target.config, path)
        lcfg = cfg.layers
        weights = load_weights(path)
        check_weight_names(cfg, weights, path)
        shapes = weight_shapes(cfg)
        cast = lambda t: t.to(device=comm.device, dtype=dtype)  # noqa: E731
        get = lambda name: cast(require(weights, name, shapes[name], path))  # noqa: E731
        hid = lcfg.hidden_size
        self.comm, self.target, self.dtype = comm, target, dtype
        self.layout = lay = HeadLayout.for_rank(lcfg, comm)
        self.fc = get("fc.weight")
        self.hidden_norm = get("hidden_norm.weight")
        self.norm = get("norm.weight")
        stacked = load_layers(weights, [f"layers.{i}." for i in range(lcfg.num_hidden_layers)], lcfg, self.layout, comm,
                              path, cast)
        self.layers = [stacked.layer(i) for i in range(lcfg.num_hidden_layers)]
        D = lcfg.head_dim
        q_rows = slice(lay.q_start * D, (lay.q_start + lay.num_heads) * D)
        kv_rows = slice(lay.kv_start * D, (lay.kv_start + lay.num_kv_heads) * D)
        # attention_bias: [q; k; v] biases of this rank's heads (added after the GEMM) and the o_proj bias (after
        # the TP reduce, once); the context K/V projection carries the k/v ones.
        self.qkv_bias, self.o_bias = [None] * len(self.layers), [None] * len(self.layers)
        # attention_sink_bias: one logit per query head that joins every softmax's denominator and carries no value
        self.sinks = [None] * len(self.layers)
        for i in range(len(self.layers)):
            p = f"layers.{i}.self_attn."
            if lcfg.attention_bias:
                self.qkv_bias[i] = torch.cat([get(p + "q_proj.bias")[q_rows], get(p + "k_proj.bias")[kv_rows],
                                              get(p + "v_proj.bias")[kv_rows]])
                self.o_bias[i] = get(p + "o_proj.bias")
            if cfg.attention_sink:
                self.sinks[i] = get(p + "attention_sink_bias")[lay.q_start : lay.q_start + lay.num_heads]
        self.embed = target.embed
        if "embed_tokens.weight" in weights:  # vLLM keeps a drafter's own embedding
            self.embed = cast(require(weights, "embed_tokens.weight", (lcfg.vocab_size, hid), path))
        self.lm_head = None
        if "lm_head.weight" in weights:  # and its own LM head
            self.lm_head = cast(require(weights, "lm_head.weight", (lcfg.vocab_size, hid), path))
        elif cfg.has_own_lm_head:
            raise QualError(f"drafter {path}: has_own_lm_head is true but the checkpoint has no lm_head.weight")
        self.mask_embedding = _mask_embedding(Path(path), cfg, hid)
        if self.mask_embedding is not None:
            self.mask_embedding = cast(self.mask_embedding)
        self.rope = Rope(lcfg.head_dim, lcfg.rope_theta, comm.device, dtype, neox=cfg.is_neox_style)
        self.scale = lcfg.head_dim**-0.5
        self.num_layers = lcfg.num_hidden_layers
        self.eps = lcfg.rms_norm_eps
        self._load_extra(weights, shapes, get)

    def _load_extra(self, weights, shapes, get) -> None:
        """What a subclass adds to the plain DFlash weights."""

    def write_context(self, ctx_features, positions, write_slots: dict, stores: dict, layer_slots) -> None:
        """Project context features (aux hidden states [Tc, n*hidden]) to every layer's K/V and cache them."""
        self.rope.reset()
        ctx = rms_norm(F.linear(ctx_features, self.fc), self.hidden_norm, self.eps)
        for i, (layer, (group, j)) in enumerate(zip(self.layers, layer_slots)):
            bias = None if self.qkv_bias[i] is None else self.qkv_bias[i][layer.attn.num_q_rows :]
            k, v = project_kv(ctx, layer.attn, self.layout, self.eps, self.rope, positions, bias)
            stores[group].write(j, write_slots[group], k, self._value_scale(v))

    def _value_scale(self, v: torch.Tensor) -> torch.Tensor:
        """dflash_config.attention_value_scale: every V, context and block, scaled before attention (vLLM)."""
        return v if self.cfg.value_scale is None else v * self.cfg.value_scale

    def embed_block(self, block_tokens: torch.Tensor) -> torch.Tensor:
        """[R, K+1] -> [R*(K+1), hidden]: the embedding, with mask_embedding.pt's vector at every mask token."""
        flat = block_tokens.reshape(-1)
        x = F.embedding(flat, self.embed)
        if self.mask_embedding is not None:
            x = torch.where((flat == self.cfg.mask_token_id)[:, None], self.mask_embedding, x)
        return x

    def forward(
        self,
        ctx_features: torch.Tensor,  # [Tc, n*hidden] new context: aux hidden states of just-committed tokens
        block_tokens: torch.Tensor,  # [R, K+1] = [last committed token, MASK * K]
        meta: DraftMeta,
        stores: dict[str, KVStore],
        layer_slots: list[tuple[str, int]],  # draft layer -> (cache group, index inside the group)
    ) -> torch.Tensor:
        """Final-normed hidden states at the K mask positions, [R, K, hidden] (logits: self.logits)."""
        R, B1 = block_tokens.shape
        if ctx_features.shape[0]:  # static in a graph: padded context rows write to the trash slot
            self.write_context(ctx_features, meta.ctx_positions, meta.write_slots, stores, layer_slots)
        self.rope.reset()
        x = self.embed_block(block_tokens)
        for i, (group, j) in enumerate(layer_slots):
            x = self._layer(i, x, meta, stores[group], group, j, R, B1)
        return rms_norm(x, self.norm, self.eps).view(R, B1, -1)[:, 1:]

    def _layer(self, i: int, x, meta: DraftMeta, store: KVStore, group: str, j: int, R: int, B1: int):
        layer = self.layers[i]
        x = x + self._attention(i, rms_norm(x, layer.input_norm, self.eps), meta, store, group, j, R, B1)
        return x + mlp(rms_norm(x, layer.post_norm, self.eps), layer.mlp, self.comm, self.target.linear)

    def _attention(self, i: int, h, meta: DraftMeta, store: KVStore, group: str, j: int, R: int, B1: int):
        """o_proj(attention of the block's queries over [context ; block] keys) for normed inputs h [R*(K+1), hidden]."""
        a, lay = self.layers[i].attn, self.layout
        D, Hk = lay.head_dim, lay.num_kv_heads
        q, kb, vb = project_qkv(h, a, lay, self.eps, self.rope, meta.block_positions.reshape(-1), self.target.linear,
                                self.qkv_bias[i])
        kc, vc = store.gather(j, meta.keys[group])
        keys = torch.cat([kc, kb.view(R, B1, Hk, D)], dim=1)
        values = torch.cat([vc, self._value_scale(vb).view(R, B1, Hk, D)], dim=1)
        out, lse = attention_with_lse(q.view(R, B1, lay.num_heads, D), keys, values, meta.masks[group], self.scale)
        if self.sinks[i] is not None:  # the sink's share of the denominator: exp(lse) / (exp(lse) + exp(sink))
            out = out * torch.sigmoid(lse - self.sinks[i]).unsqueeze(-1).to(out.dtype)
        y = self.comm.all_reduce_tp(self.target.linear(out.reshape(R * B1, -1), a.o))
        return y if self.o_bias[i] is None else y + self.o_bias[i]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden) if self.lm_head is None else F.linear(hidden, self.lm_head)

    def candidate_edges(self, hidden, logits, anchor):
        """DFlash proposes the argmax of its logits: no candidate head."""
        return None


class DFlash2Drafter(DFlashDrafter):
    """DFlash2: a grouped causal convolution before and after each layer's attention and MLP, the block's input
    embeddings scaled, and a candidate selector that scores edges between consecutive positions' top-k candidates."""

    def _load_extra(self, weights, shapes, get) -> None:
        p = self.cfg.dflash2
        hid = self.cfg.layers.hidden_size
        self.taps, self.group_size, self.top_k = p.conv_kernel_size, p.conv_group_size, p.selector_top_k
        self.groups = hid // p.conv_group_size
        # convs[i][kind] = (base_kernel [2, taps, hidden], kernel_projection [2*taps*groups, hidden]); replicated
        self.convs = [{kind: (get(f"layers.{i}.{kind}.base_kernel"), get(f"layers.{i}.{kind}.kernel_projection.weight"))
                       for kind in ("attention_conv", "mlp_conv")} for i in range(self.num_layers)]
        self.predecessor = get("candidate_selector.predecessor_codebook")
        self.successor = get("candidate_selector.successor_codebook")
        self.hidden_projection = get("candidate_selector.hidden_projection.weight")

    def embed_block(self, block_tokens):
        x = super().embed_block(block_tokens)
        scale = self.cfg.dflash2.input_embedding_scale
        return x if scale == 1.0 else x * scale

    def _conv_pair(self, i: int, kind: str, h: torch.Tensor, inner, block: int) -> torch.Tensor:
        """finish(inner(prepare(h))): coefficients from h, one convolution before inner and one after it."""
        base, proj = self.convs[i][kind]
        coef = F.linear(h, proj).view(h.shape[0], 2, self.taps, self.groups)
        y = inner(grouped_conv(h, coef[:, 0], base[0], block, self.group_size))
        return grouped_conv(y, coef[:, 1], base[1], block, self.group_size)

    def _layer(self, i: int, x, meta, store, group, j, R, B1):
        layer = self.layers[i]
        attend = lambda h: self._attention(i, h, meta, store, group, j, R, B1)  # noqa: E731
        x = x + self._conv_pair(i, "attention_conv", rms_norm(x, layer.input_norm, self.eps), attend, B1)
        mix = lambda h: mlp(h, layer.mlp, self.comm, self.target.linear)  # noqa: E731
        return x + self._conv_pair(i, "mlp_conv", rms_norm(x, layer.post_norm, self.eps), mix, B1)

    def candidate_edges(self, hidden, logits, anchor):
        """(candidates [R, K, k], scores [R, K, k, k]): the top-k of the logits, their values scaled by
        output_multiplier then soft-capped (vLLM: after the top-k, monotone), plus the selector's edge term
        <predecessor[prev] * hidden_projection(h), successor[cand]>; position 0's predecessor is the anchor token."""
        p = self.cfg.dflash2
        values, ids = torch.topk(logits, self.top_k, dim=-1)
        values = values.to(torch.promote_types(values.dtype, torch.float32)) * p.output_multiplier
        if p.final_logit_softcapping:
            values = torch.tanh(values / p.final_logit_softcapping) * p.final_logit_softcapping
        return ids, values[:, :, None, :] + selector_edges(self.predecessor, self.successor, self.hidden_projection,
                                                          ids, hidden, anchor)


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block: int, group_size: int) -> torch.Tensor:
    """DFlash2's grouped causal convolution over blocks laid end to end (row r sits at position r % block of its block):
    out[r] = sum_t (base[t] + delta[r, t, group]) * x[r - t] over the taps t <= that position.

    x [N, hidden], delta [N, taps, groups] (per row, per group), base [taps, hidden] (per channel).
    """
    N, hid = x.shape
    taps, groups = base.shape[0], hid // group_size
    xs = x.view(N, groups, group_size)
    coef = base.view(1, taps, groups, group_size) + delta.unsqueeze(-1)  # [N, taps, G, g]
    pos = torch.arange(N, device=x.device) % block
    out = coef[:, 0] * xs
    for t in range(1, taps):  # taps reach back inside the row's own block only
        shifted = F.pad(xs[:-t], (0, 0, 0, 0, t, 0)) if t < N else torch.zeros_like(xs)
        out = out + coef[:, t] * shifted * (pos >= t).view(N, 1, 1).to(x.dtype)
    return out.reshape(N, hid)


def selector_edges(predecessor, successor, hidden_projection, candidates, hidden, anchor) -> torch.Tensor:
    """[R, K, k, k]: <predecessor[prev] * hidden_projection(h), successor[cand]> for every (previous candidate p,
    candidate c) pair of consecutive positions; position 0's previous token is the anchor (the block's first token)."""
    k = candidates.shape[-1]
    h = F.linear(hidden, hidden_projection)  # [R, K, rank]
    prev = torch.cat([anchor[:, None, None].expand(-1, 1, k), candidates[:, :-1]], dim=1)
    return torch.einsum("blpr,blcr->blpc", predecessor[prev] * h[:, :, None], successor[candidates])


def _mask_embedding(path: Path, cfg: DFlashConfig, hidden: int) -> torch.Tensor | None:
    """mask_embedding.pt (a tensor, or {"embedding", "mask_token_id"}), as vLLM reads it; None when absent."""
    f = path / MASK_EMBEDDING_FILE
    if not f.is_file():
        return None
    state = load_torch(f, MAX_MASK_EMBEDDING_BYTES, "mask embedding")  # tensors only: no pickled code runs
    if isinstance(state, dict):
        if state.get("mask_token_id", cfg.mask_token_id) != cfg.mask_token_id:
            raise QualError(f"{f}: mask_token_id {state.get('mask_token_id')} differs from dflash_config.mask_token_id "
                            f"{cfg.mask_token_id}")
        state = state.get("embedding")
    if not isinstance(state, torch.Tensor) or state.numel() != hidden:
        raise QualError(f"{f}: expected a tensor of {hidden} values (the mask token's embedding)")
    return state.reshape(-1)
