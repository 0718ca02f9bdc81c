"""Building blocks shared by the target and the drafter: norms, RoPE, TP-sharded weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qual.errors import QualError
from qual.runtime.checkpoint import Qwen3Config, require
from qual.runtime.parallel import Comm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: statistics in at least float32, result in the input dtype.

    weight is [D] or, for per-head norms of several heads at once, [heads, D].
    """
    if x.dtype in (torch.float16, torch.bfloat16) or weight.dim() > 1:
        # As transformers: normalise (fused; float32 statistics), cast, then scale in the input dtype.
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
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
    """q, k and v weights stacked in one matrix, so one GEMM projects all three."""

    qkv: torch.Tensor  # [(heads + 2*kv)*D, hidden]
    o: torch.Tensor  # [hidden, heads*D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    qk_norm: torch.Tensor  # [heads + kv, D]: q_norm per query head, then k_norm per KV head
    num_q_rows: int

    @property
    def kv(self) -> torch.Tensor:
        """The [k; v] rows (DFlash context tokens need no queries)."""
        return self.qkv[self.num_q_rows :]


@dataclass
class MlpWeights:
    """gate and up weights stacked in one matrix (one GEMM)."""

    gate_up: torch.Tensor  # [2*I/tp, hidden]
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
    q_norm, k_norm = cast(w("self_attn.q_norm.weight", (D,))), cast(w("self_attn.k_norm.weight", (D,)))
    qk_norm = torch.cat([q_norm.expand(layout.num_heads, D), k_norm.expand(layout.num_kv_heads, D)]).contiguous()
    return LayerWeights(
        input_norm=cast(w("input_layernorm.weight", (hid,))),
        post_norm=cast(w("post_attention_layernorm.weight", (hid,))),
        attn=AttentionWeights(cast(torch.cat([q, k, v])), cast(o), q_norm, k_norm, qk_norm, q.shape[0]),
        mlp=MlpWeights(
            cast(torch.cat([w("mlp.gate_proj.weight", (inter, hid))[lo:hi], w("mlp.up_proj.weight", (inter, hid))[lo:hi]])),
            cast(w("mlp.down_proj.weight", (hid, inter))[:, lo:hi]),
        ),
    )


def mlp(x: torch.Tensor, m: MlpWeights, comm: Comm, linear=F.linear) -> torch.Tensor:
    """SwiGLU MLP, column- then row-parallel across TP."""
    gate, up = linear(x, m.gate_up).chunk(2, dim=-1)
    return comm.all_reduce_tp(linear(F.silu(gate) * up, m.down))


def project_qkv(x, a: AttentionWeights, layout: HeadLayout, eps: float, rope: Rope, positions, linear=F.linear):
    """q, k, v for tokens x [T, hidden] at positions [T]: per-head RMSNorm, then RoPE.

    One GEMM, one norm and one rotation cover the query and key heads together.
    """
    T, D, H = x.shape[0], layout.head_dim, layout.num_heads
    qkv = linear(x, a.qkv).view(T, H + 2 * layout.num_kv_heads, D)
    qk = rope(rms_norm(qkv[:, : H + layout.num_kv_heads], a.qk_norm, eps), positions)
    return qk[:, :H], qk[:, H:], qkv[:, H + layout.num_kv_heads :]


def project_kv(x, a: AttentionWeights, layout: HeadLayout, eps: float, rope: Rope, positions):
    """k, v only (DFlash context tokens never query)."""
    T, D, Hk = x.shape[0], layout.head_dim, layout.num_kv_heads
    kv = F.linear(x, a.kv).view(T, 2 * Hk, D)
    return rope(rms_norm(kv[:, :Hk], a.k_norm, eps), positions), kv[:, Hk:]
