"""DFlash drafter: context K/V from target aux hidden states, one forward drafts a whole block (DESIGN.md §3)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qual.errors import QualError
from qual.runtime.attention import attention_with_lse
from qual.runtime.checkpoint import DFlashConfig, load_draft_config, load_weights, require
from qual.runtime.models.layers import HeadLayout, Rope, load_layer, mlp, project_kv, project_qkv, rms_norm
from qual.runtime.models.qwen3 import Qwen3Target
from qual.runtime.paged import KeyView, KVStore
from qual.runtime.parallel import Comm


@dataclass
class DraftMeta:
    """Metadata of one draft step on this rank, per draft cache group."""

    ctx_positions: torch.Tensor  # [Tc] positions of the new context tokens
    write_slots: dict[str, torch.Tensor]  # group -> [Tc]; not stored on this rank = the trash slot
    keys: dict[str, KeyView]  # group -> context keys per request (new ones included)
    block_positions: torch.Tensor  # [R, K+1]


class DFlashDrafter:
    """This rank's shard of a DFlash drafter; embedding and LM head are the target's."""

    def __init__(self, path: str | Path, comm: Comm, dtype: torch.dtype, target: Qwen3Target):
        self.cfg: DFlashConfig = load_draft_config(path)
        cfg, lcfg, tcfg = self.cfg, self.cfg.layers, target.cfg
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
        self.layers = [load_layer(weights, f"layers.{i}.", lcfg, self.layout, comm, path, cast) for i in range(lcfg.num_hidden_layers)]
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
