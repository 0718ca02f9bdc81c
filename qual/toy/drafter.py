"""The DFlash drafter as a trainable torch module, in the public checkpoint format (docs/vllm.md).

It computes exactly the function of docs/dflash.md: context features
hidden_norm(fc(concat aux)), per layer q from the block only, k/v from
[context ; block], q_norm/k_norm per head before RoPE, GQA, non-causal block,
SiLU MLP, final norm; embedding and LM head are the target's (passed in).
Training runs many anchors of one sequence in one pass: context K/V of the
whole sequence plus one block per anchor, and a boolean mask that lets a block
see context strictly before its anchor and its own block.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qual.checkpoints.dflash import DFlashConfig, write_dflash
from qual.checkpoints.qwen3 import Qwen3Config
from qual.errors import QualError
from qual.runtime.models import layers
from qual.runtime.models.layers import rms_norm
from qual.toy.config import ModelShape
from qual.userfiles import load_safetensors, read_json


class RMSNorm(nn.Module):
    """The runtime's RMSNorm (qual/runtime/models/layers.py) with a trainable weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [..., head_dim] for integer positions (the runtime's RoPE)."""
    return layers.rope_cos_sin(positions, layers.rope_inv_freq(head_dim, theta, positions.device), dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, hd]; cos/sin [B, S, hd]."""
    return layers.rotate(x, cos[:, None], sin[:, None])


class Attention(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, q_rope, kv_rope, mask: torch.Tensor) -> torch.Tensor:
        """h [B, Q, H] block rows; ctx [B, T, H]; mask [B, Q, T+Q] (True = attend)."""
        b, q_len, _ = h.shape
        kv_in = torch.cat([ctx, h], dim=1)  # [B, T+Q, H]
        q = self.q_norm(self.q_proj(h).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *q_rope), apply_rope(k, *kv_rope)
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)  # [B, heads, T+Q, hd]
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.draft_mlp_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.draft_mlp_size, bias=False)
        self.down_proj = nn.Linear(s.draft_mlp_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedConv(nn.Module):
    """DFlash2's grouped causal convolution along each draft block (vLLM's checkpoint names).

    For block row t: out_t = sum over taps j with t - j inside the block of (base[j] + delta_t[j, group]) * h_{t-j},
    delta projected from the input rows; `prepare` convolves with side 0 and returns side 1's deltas for `finish`.
    Initialised as the identity (base tap 0 = 1, the rest and the projection 0): a DFlash drafter grows into it.
    """

    def __init__(self, s: ModelShape):
        super().__init__()
        self.taps, self.group, self.block = s.conv_kernel_size, s.conv_group_size, s.block_size
        self.groups = s.hidden_size // s.conv_group_size
        base = torch.zeros(2, self.taps, s.hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(s.hidden_size, 2 * self.taps * self.groups, bias=False)

    def _convolve(self, h: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """h [B, A*bs, H] (A blocks of bs rows), delta [B, A*bs, taps, G]."""
        b, q, hid = h.shape
        blocks = h.view(b, q // self.block, self.block, self.groups, self.group)
        coef = (self.base_kernel[side].view(self.taps, self.groups, self.group) + delta.view(
            b, q // self.block, self.block, self.taps, self.groups, 1))  # [B, A, bs, taps, G, gs]
        out = coef[:, :, :, 0] * blocks
        for j in range(1, self.taps):
            shifted = F.pad(blocks[:, :, :-j], (0, 0, 0, 0, j, 0))  # row t sees row t - j of its own block
            out = out + coef[:, :, :, j] * shifted
        return out.reshape(b, q, hid)

    def prepare(self, h: torch.Tensor):
        delta = self.kernel_projection(h).view(*h.shape[:2], 2, self.taps, self.groups)
        return self._convolve(h, delta[:, :, 0], 0), delta[:, :, 1]

    def finish(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self._convolve(h, delta, 1)


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelShape, kind: str = "full_attention"):
        super().__init__()
        self.kind = kind
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        if s.dflash2:
            self.attention_conv, self.mlp_conv = GroupedConv(s), GroupedConv(s)

    def forward(self, x, ctx, q_rope, kv_rope, masks: dict):
        h = self.input_layernorm(x)
        if hasattr(self, "attention_conv"):
            h, delta = self.attention_conv.prepare(h)
            h = self.attention_conv.finish(self.self_attn(h, ctx, q_rope, kv_rope, masks[self.kind]), delta)
        else:
            h = self.self_attn(h, ctx, q_rope, kv_rope, masks[self.kind])
        x = x + h
        h = self.post_attention_layernorm(x)
        if hasattr(self, "mlp_conv"):
            h, delta = self.mlp_conv.prepare(h)
            return x + self.mlp_conv.finish(self.mlp(h), delta)
        return x + self.mlp(h)


class CandidateSelector(nn.Module):
    """DFlash2's low-rank re-scoring of each step's top-k candidates given the token before it (vLLM's names).

    edge(prev, cand) = unary(cand) + (predecessor[prev] * hidden_projection(h)) . successor[cand]. Initialised to
    zero: the walk then takes each step's best unary candidate, DFlash's argmax.
    """

    def __init__(self, s: ModelShape):
        super().__init__()
        self.top_k = s.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(s.vocab_size, s.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(s.vocab_size, s.selector_rank))
        self.hidden_projection = nn.Linear(s.hidden_size, s.selector_rank, bias=False)

    def edges(self, prev: torch.Tensor, cand: torch.Tensor, unary: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """prev [..., P], cand [..., C] token ids, unary [..., C], h [..., H] -> scores [..., P, C]."""
        pred = self.predecessor_codebook[prev] * self.hidden_projection(h)[..., None, :]  # [..., P, r]
        return unary[..., None, :] + torch.einsum("...pr,...cr->...pc", pred, self.successor_codebook[cand])


class DFlashDrafter(nn.Module):
    """State-dict keys are exactly the public DFlash checkpoint names (no `model.` prefix)."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        n_aux = len(shape.target_layer_ids)
        self.fc = nn.Linear(n_aux * shape.hidden_size, shape.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(shape, kind) for kind in shape.draft_kinds)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        for m in self.modules():  # DFlash2's extras start as the identity / as DFlash (see their docstrings)
            if isinstance(m, GroupedConv):
                nn.init.zeros_(m.kernel_projection.weight)
        if shape.dflash2:
            self.candidate_selector = CandidateSelector(shape)
            nn.init.zeros_(self.candidate_selector.hidden_projection.weight)

    def propose(self, h: torch.Tensor, anchor: torch.Tensor, lm_head) -> torch.Tensor:
        """Draft tokens [B, K] from the mask rows' hidden states h [B, K, H] (anchor [B]: the block's first token).

        DFlash: each position's argmax. DFlash2: a greedy walk over each step's top-k candidates, each scored by
        the selector from the token chosen before it (vLLM's DFlash2 speculator at temperature 0)."""
        logits = lm_head(h)
        if not self.shape.dflash2:
            return logits.argmax(-1)
        sel = self.candidate_selector
        unary, cand = logits.float().topk(sel.top_k, dim=-1)  # [B, K, k]
        prev, out = anchor, []
        for step in range(h.shape[1]):
            scores = sel.edges(prev[:, None], cand[:, step], unary[:, step], h[:, step].float())[:, 0]  # [B, k]
            prev = cand[:, step].gather(1, scores.argmax(-1, keepdim=True))[:, 0]
            out.append(prev)
        return torch.stack(out, 1)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, n_aux*H] (concatenated target layer outputs) -> context features [B, T, H]."""
        return self.hidden_norm(self.fc(aux))

    def forward(self, ctx: torch.Tensor, ctx_positions: torch.Tensor, x: torch.Tensor,
                block_positions: torch.Tensor, mask: torch.Tensor | dict) -> torch.Tensor:
        """Block hidden states after the final norm.

        ctx [B, T, H] context features; ctx_positions [B, T]; x [B, Q, H] embedded block tokens;
        block_positions [B, Q]; mask [B, Q, T+Q] bool, or one per layer kind {"full_attention": ...,
        "sliding_attention": ...}. Returns [B, Q, H].
        """
        s = self.shape
        masks = mask if isinstance(mask, dict) else {"full_attention": mask, "sliding_attention": mask}
        q_rope = rope_cos_sin(block_positions, s.head_dim, s.rope_theta, x.dtype)
        kv_rope = rope_cos_sin(torch.cat([ctx_positions, block_positions], dim=1), s.head_dim, s.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, q_rope, kv_rope, masks)
        return self.norm(x)


@torch.no_grad()
def grow_from(drafter: DFlashDrafter, init: DFlashDrafter) -> None:
    """Load `init` into the same-or-larger `drafter` so that both compute the same function.

    The drafter may have a wider MLP and may read a superset of init's target layers:
    new gate/up rows keep their random init while the matching down_proj columns are
    zero, and fc columns of the new target layers are zero. Training then starts from
    init's acceptance instead of from scratch.
    """
    new, old = drafter.shape, init.shape
    fixed = ("vocab_size", "hidden_size", "num_heads", "head_dim", "num_kv_heads", "draft_layers", "block_size")
    changed = [f for f in fixed if getattr(new, f) != getattr(old, f)]
    if changed:
        raise QualError(f"draft_init: {', '.join(changed)} differ ({[getattr(old, f) for f in changed]} -> "
                        f"{[getattr(new, f) for f in changed]}); only the MLP width and target layers can grow")
    if new.draft_mlp_size < old.draft_mlp_size or not set(old.target_layer_ids) <= set(new.target_layer_ids):
        raise QualError(f"draft_init: MLP {old.draft_mlp_size} -> {new.draft_mlp_size}, target layers "
                        f"{list(old.target_layer_ids)} -> {list(new.target_layer_ids)}: can only grow")
    state = drafter.state_dict()
    h, m = old.hidden_size, old.draft_mlp_size
    for name, value in init.state_dict().items():
        dest = state[name]
        if name == "fc.weight":
            dest.zero_()
            for i, layer in enumerate(old.target_layer_ids):
                j = new.target_layer_ids.index(layer)
                dest[:, j * h:(j + 1) * h] = value[:, i * h:(i + 1) * h]
        elif name.endswith("mlp.down_proj.weight"):
            dest.zero_()
            dest[:, :m] = value
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            dest[:m] = value
        else:
            dest.copy_(value)


def anchor_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, window: int | None = None) -> torch.Tensor:
    """Training mask [B, A*bs, ctx_len + A*bs]: block a sees context j < anchors[a] and all of block a.

    With a window (sliding_attention layers): causal inside the block, and a query at position p sees only
    positions > p - window (vLLM's per-query-token window)."""
    b, a = anchors.shape
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q] anchor of each query row
    j = torch.arange(ctx_len, device=dev)[None, None, :]
    ctx_ok = j < q_anchor[:, :, None]  # [B, Q, T]
    block_id = torch.arange(a, device=dev).repeat_interleave(block_size)  # [Q]
    own = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)  # [B, Q, Q]
    if window is None:
        return torch.cat([ctx_ok, own], dim=2)
    k = torch.arange(block_size, device=dev).repeat(a)  # [Q] offset in the block
    q_pos = q_anchor + k  # [B, Q]
    ctx_ok = ctx_ok & (j > q_pos[:, :, None] - window)
    own = own & (k[None, :] <= k[:, None]) & ((k[:, None] - k[None, :]) < window)
    return torch.cat([ctx_ok, own], dim=2)


def draft_config(shape: ModelShape, mask_token_id: int, eos_token_id: int) -> DFlashConfig:
    """The drafter's config in the public DFlash format (docs/dflash.md)."""
    layers_cfg = Qwen3Config(shape.vocab_size, shape.hidden_size, shape.draft_layers, shape.num_heads, shape.num_kv_heads,
                             shape.head_dim, shape.draft_mlp_size, shape.rms_norm_eps, shape.rope_theta,
                             max_position_embeddings=shape.max_position_embeddings, eos_token_id=eos_token_id)
    sliding = "sliding_attention" in shape.draft_kinds
    return DFlashConfig(layers_cfg, shape.block_size, shape.num_layers, mask_token_id, tuple(shape.target_layer_ids),
                        shape.draft_kinds, shape.draft_sliding_window if sliding else None)


def dflash2_overrides(shape: ModelShape, mask_token_id: int) -> dict:
    """The config.json fields a DFlash2 drafter adds (vLLM's qwen3_dflash2 names)."""
    return {"architectures": ["DFlash2DraftModel"],
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(shape.target_layer_ids),
                              "conv_kernel_size": shape.conv_kernel_size, "conv_group_size": shape.conv_group_size,
                              "selector_rank": shape.selector_rank, "selector_top_k": shape.selector_top_k}}


def save_drafter(drafter: DFlashDrafter, out_dir: Path, mask_token_id: int, eos_token_id: int) -> None:
    """bf16 weights + config.json, the public format."""
    s = drafter.shape
    write_dflash(out_dir, draft_config(s, mask_token_id, eos_token_id), drafter.state_dict(), dtype=torch.bfloat16,
                 **(dflash2_overrides(s, mask_token_id) if s.dflash2 else {}))


def shape_from_config(cfg: dict, num_target_layers: int | None = None) -> ModelShape:
    return ModelShape(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=num_target_layers or cfg["num_target_layers"], num_heads=cfg["num_attention_heads"],
        head_dim=cfg["head_dim"], num_kv_heads=cfg["num_key_value_heads"],
        intermediate_size=cfg["intermediate_size"], rope_theta=float(cfg["rope_theta"]),
        rms_norm_eps=cfg["rms_norm_eps"], max_position_embeddings=cfg["max_position_embeddings"],
        draft_layers=cfg["num_hidden_layers"], block_size=cfg["block_size"],
        target_layer_ids=tuple(cfg["dflash_config"]["target_layer_ids"]),
        draft_layer_types=tuple(cfg.get("layer_types") or ()), draft_sliding_window=cfg.get("sliding_window") or 64,
        **({k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
           if "DFlash2DraftModel" in cfg.get("architectures", []) else {}),
    )


def load_drafter(path: Path, device: str, dtype: torch.dtype = torch.float32) -> tuple[DFlashDrafter, dict]:
    """(drafter, config dict) from a saved checkpoint."""
    cfg = read_json(path / "config.json")
    drafter = DFlashDrafter(shape_from_config(cfg))
    state = load_safetensors(path / "model.safetensors")
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise QualError(f"{path}: drafter weights missing {missing} unexpected {unexpected}")
    return drafter.to(device=device, dtype=dtype).eval(), cfg
