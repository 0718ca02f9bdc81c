"""Building blocks shared by the target and the drafter: norms, RoPE, TP-sharded weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qual.errors import QualError
from qual.runtime.checkpoint import Qwen3Config, require
from qual.runtime.parallel import Comm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: statistics in at least float32, result in the input dtype."""
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):  # as transformers: normalise in float32, cast, then scale
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel


class Rope:
    """Rotary embedding (rotate-half form), cos/sin computed as transformers does."""

    def __init__(self, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype):
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        self.inv_freq = 1.0 / (theta**exponent)  # float32, as in transformers
        self.dtype = dtype
        self._cached = None

    def reset(self) -> None:
        """Forget cached cos/sin; called at the start of every forward so a CUDA graph recomputes them from its inputs."""
        self._cached = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer rotates by the same positions: compute once per forward.
        if self._cached is not None and self._cached[0] is positions:
            return self._cached[1], self._cached[2]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]
        self._cached = (positions, cos, sin)
        return cos, sin

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D], positions: [T]."""
        cos, sin = self.cos_sin(positions)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


@dataclass
class HeadLayout:
    """Which attention / KV heads this TP rank holds."""

    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    head_dim: int
    q_start: int
    kv_start: int

    @classmethod
    def for_rank(cls, cfg: Qwen3Config, comm: Comm) -> "HeadLayout":
        tp, r = comm.tp_size, comm.tp_rank
        heads = cfg.num_attention_heads // tp
        if cfg.num_key_value_heads >= tp:
            kv, kv_start = cfg.num_key_value_heads // tp, r * (cfg.num_key_value_heads // tp)
        else:  # fewer KV heads than ranks: each is replicated on tp / num_kv ranks
            kv, kv_start = 1, r // (tp // cfg.num_key_value_heads)
        return cls(heads, kv, cfg.head_dim, r * heads, kv_start)


def _rows(t: torch.Tensor, start: int, count: int, per: int) -> torch.Tensor:
    return t[start * per : (start + count) * per]


@dataclass
class AttentionWeights:
    q: torch.Tensor  # [heads*D, hidden]
    k: torch.Tensor  # [kv*D, hidden]
    v: torch.Tensor
    o: torch.Tensor  # [hidden, heads*D]
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@dataclass
class MlpWeights:
    gate: torch.Tensor  # [I/tp, hidden]
    up: torch.Tensor
    down: torch.Tensor  # [hidden, I/tp]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: AttentionWeights
    mlp: MlpWeights


def load_layer(
    weights: dict, prefix: str, cfg: Qwen3Config, layout: HeadLayout, comm: Comm, where, cast
) -> LayerWeights:
    """Slice one decoder layer's tensors for this TP rank."""
    H, D, hid, inter = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    kvh = cfg.num_key_value_heads
    if inter % comm.tp_size:
        raise QualError(f"{where}: intermediate_size={inter} is not divisible by tp={comm.tp_size}")
    w = lambda name, shape: require(weights, prefix + name, shape, where)  # noqa: E731
    q = _rows(w("self_attn.q_proj.weight", (H * D, hid)), layout.q_start, layout.num_heads, D)
    k = _rows(w("self_attn.k_proj.weight", (kvh * D, hid)), layout.kv_start, layout.num_kv_heads, D)
    v = _rows(w("self_attn.v_proj.weight", (kvh * D, hid)), layout.kv_start, layout.num_kv_heads, D)
    o = w("self_attn.o_proj.weight", (hid, H * D))[:, layout.q_start * D : (layout.q_start + layout.num_heads) * D]
    part = inter // comm.tp_size
    lo, hi = comm.tp_rank * part, (comm.tp_rank + 1) * part
    return LayerWeights(
        input_norm=cast(w("input_layernorm.weight", (hid,))),
        post_norm=cast(w("post_attention_layernorm.weight", (hid,))),
        attn=AttentionWeights(
            cast(q), cast(k), cast(v), cast(o),
            cast(w("self_attn.q_norm.weight", (D,))), cast(w("self_attn.k_norm.weight", (D,))),
        ),
        mlp=MlpWeights(
            cast(w("mlp.gate_proj.weight", (inter, hid))[lo:hi]),
            cast(w("mlp.up_proj.weight", (inter, hid))[lo:hi]),
            cast(w("mlp.down_proj.weight", (hid, inter))[:, lo:hi]),
        ),
    )


def mlp(x: torch.Tensor, m: MlpWeights, comm: Comm) -> torch.Tensor:
    """SwiGLU MLP, column- then row-parallel across TP."""
    h = F.silu(F.linear(x, m.gate)) * F.linear(x, m.up)
    return comm.all_reduce_tp(F.linear(h, m.down))


def project_qkv(x, a: AttentionWeights, layout: HeadLayout, eps: float, rope: Rope, positions):
    """q, k, v for tokens x [T, hidden] at positions [T]: per-head RMSNorm, then RoPE."""
    T, D = x.shape[0], layout.head_dim
    q = F.linear(x, a.q).view(T, layout.num_heads, D)
    k = F.linear(x, a.k).view(T, layout.num_kv_heads, D)
    v = F.linear(x, a.v).view(T, layout.num_kv_heads, D)
    q = rope(rms_norm(q, a.q_norm, eps), positions)
    k = rope(rms_norm(k, a.k_norm, eps), positions)
    return q, k, v


def project_kv(x, a: AttentionWeights, layout: HeadLayout, eps: float, rope: Rope, positions):
    """k, v only (DFlash context tokens never query)."""
    T, D = x.shape[0], layout.head_dim
    k = rope(rms_norm(F.linear(x, a.k).view(T, layout.num_kv_heads, D), a.k_norm, eps), positions)
    v = F.linear(x, a.v).view(T, layout.num_kv_heads, D)
    return k, v
