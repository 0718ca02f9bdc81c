"""DFlash drafter: context K/V from target aux hidden states, one forward drafts a whole block (docs/dflash.md)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from qual.checkpoints.dflash import DFlashConfig
from qual.checkpoints.io import load_weights, require
from qual.errors import QualError
from qual.runtime.attention import attention_with_lse
from qual.runtime.config import ParallelConfig
from qual.runtime.kv_cache import KVCacheGroup, KVCacheSpec
from qual.runtime.models.base import DraftMeta, TargetModel
from qual.runtime.models.layers import HeadLayout, Rope, load_layers, mlp, project_kv, project_qkv, rms_norm
from qual.runtime.paged import KVStore
from qual.runtime.parallel import Comm


def group_name(kind: str) -> str:
    """Draft layers share a cache group per attention kind."""
    return "draft" if kind == "full_attention" else "draft_sliding"


class DFlashDrafter:
    """This rank's shard of a DFlash drafter; embedding and LM head are the target's."""

    @staticmethod
    def parse_config(raw: dict, path: Path) -> DFlashConfig:
        return DFlashConfig.from_json(raw, path)

    @staticmethod
    def check_parallel(cfg: DFlashConfig, parallel: ParallelConfig) -> None:
        parallel.check_model(cfg.layers.num_attention_heads, cfg.layers.num_key_value_heads, "drafter")

    @staticmethod
    def cache_groups(cfg: DFlashConfig, comm: Comm, dtype_bytes: int, draft_kv: str,
                     draft_window: int | None) -> list[KVCacheGroup]:
        """Draft layers grouped by attention kind; replicated (the fix) or sharded like the target (legacy)."""
        dl = HeadLayout.for_rank(cfg.layers, comm)
        by_name: dict[str, KVCacheGroup] = {}
        for i, kind in enumerate(cfg.layer_types):
            sliding = kind == "sliding_attention"
            spec = KVCacheSpec("gqa", sharded=draft_kv == "sharded", dtype_bytes=dtype_bytes, num_kv_heads=dl.num_kv_heads,
                               head_dim=dl.head_dim, window=cfg.sliding_window if sliding else draft_window,
                               attention="sliding" if sliding else "full")
            g = KVCacheGroup(group_name(kind), spec, (f"draft.{i}",))
            by_name[g.name] = by_name[g.name].merge(g) if g.name in by_name else g
        return list(by_name.values())

    def __init__(self, path: str | Path, cfg: DFlashConfig, comm: Comm, dtype: torch.dtype, target: TargetModel):
        self.cfg = self.config = cfg
        lcfg, tcfg = cfg.layers, target.config
        if lcfg.hidden_size != tcfg.hidden_size or lcfg.vocab_size != tcfg.vocab_size:
            raise QualError(f"drafter {path}: hidden_size/vocab_size must match the target's ({tcfg.hidden_size}/{tcfg.vocab_size})")
        if cfg.num_target_layers != tcfg.num_hidden_layers:
            raise QualError(f"drafter {path}: num_target_layers={cfg.num_target_layers} but the target has {tcfg.num_hidden_layers} layers")
        weights = load_weights(path)
        cast = lambda t: t.to(device=comm.device, dtype=dtype)  # noqa: E731
        n_ctx = len(cfg.target_layer_ids)
        self.comm, self.target = comm, target
        self.layout = HeadLayout.for_rank(lcfg, comm)
        self.fc = cast(require(weights, "fc.weight", (lcfg.hidden_size, n_ctx * lcfg.hidden_size), path))
        self.hidden_norm = cast(require(weights, "hidden_norm.weight", (lcfg.hidden_size,), path))
        self.norm = cast(require(weights, "norm.weight", (lcfg.hidden_size,), path))
        stacked = load_layers(weights, [f"layers.{i}." for i in range(lcfg.num_hidden_layers)], lcfg, self.layout, comm,
                              path, cast)
        self.layers = [stacked.layer(i) for i in range(lcfg.num_hidden_layers)]
        self.rope = Rope(lcfg.head_dim, lcfg.rope_theta, comm.device, dtype)
        self.scale = lcfg.head_dim**-0.5
        self.num_layers = lcfg.num_hidden_layers
        B1 = cfg.block_size  # masks inside the block, built once on the device (nothing host-side in a graph)
        full = torch.ones(B1, B1, dtype=torch.bool, device=comm.device)
        self.block_masks = {"full_attention": full, "sliding_attention": full.tril()}

    def write_context(self, ctx_features, positions, write_slots: dict, stores: dict, layer_slots) -> None:
        """Project context features (aux hidden states [Tc, n*hidden]) to every layer's K/V and cache them."""
        eps = self.cfg.layers.rms_norm_eps
        self.rope.reset()
        ctx = rms_norm(F.linear(ctx_features, self.fc), self.hidden_norm, eps)
        for layer, (group, j) in zip(self.layers, layer_slots):
            k, v = project_kv(ctx, layer.attn, self.layout, eps, self.rope, positions)
            stores[group].write(j, write_slots[group], k, v)

    def forward(
        self,
        ctx_features: torch.Tensor,  # [Tc, n*hidden] new context: aux hidden states of just-committed tokens
        block_tokens: torch.Tensor,  # [R, K+1] = [last committed token, MASK * K]
        meta: DraftMeta,
        stores: dict[str, KVStore],
        layer_slots: list[tuple[str, int]],  # draft layer -> (cache group, index inside the group)
    ) -> torch.Tensor:
        """Final-normed hidden states at the K mask positions, [R, K, hidden] (logits = the target's LM head)."""
        eps = self.cfg.layers.rms_norm_eps
        R, B1 = block_tokens.shape
        if ctx_features.shape[0]:  # static in a graph: padded context rows write to the trash slot
            self.write_context(ctx_features, meta.ctx_positions, meta.write_slots, stores, layer_slots)
        self.rope.reset()
        x = F.embedding(block_tokens.reshape(-1), self.target.embed)  # [R*(K+1), hidden]
        block_pos = meta.block_positions.reshape(-1)
        for layer, kind, (group, j) in zip(self.layers, self.cfg.layer_types, layer_slots):
            a, lay = layer.attn, self.layout
            h = rms_norm(x, layer.input_norm, eps)
            q, kb, vb = project_qkv(h, a, lay, eps, self.rope, block_pos, self.target.linear)
            kc, vc = stores[group].gather(j, meta.keys[group])
            D, Hk = lay.head_dim, lay.num_kv_heads
            keys = torch.cat([kc, kb.view(R, B1, Hk, D)], dim=1)
            values = torch.cat([vc, vb.view(R, B1, Hk, D)], dim=1)
            view = meta.keys[group]
            # full_attention: non-causal inside the block; sliding_attention: causal inside it
            in_block = self.block_masks[kind][:B1, :B1]
            mask = torch.cat([view.valid[:, None, :].expand(R, B1, -1), in_block.expand(R, B1, B1)], dim=2)
            out, _ = attention_with_lse(q.view(R, B1, lay.num_heads, D), keys, values, mask, self.scale)
            x = x + self.comm.all_reduce_tp(self.target.linear(out.reshape(R * B1, -1), a.o))
            x = x + mlp(rms_norm(x, layer.post_norm, eps), layer.mlp, self.comm, self.target.linear)
        return rms_norm(x, self.norm, eps).view(R, B1, -1)[:, 1:]
