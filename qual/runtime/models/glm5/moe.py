"""Feed-forward blocks: the clamped SwiGLU MLP and the MoE (sigmoid router, grouped top-k, shared experts).

Flat tokens [T, hidden]. Under TP every intermediate dimension (dense MLP, shared experts, and each routed
expert's) is split column/row-wise, so each block returns this rank's row-parallel partial [T, hidden]; the
router is replicated and gives every rank the same routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qual.checkpoints.fp8 import dequantize
from qual.runtime.models.glm5.numerics import Fp8Weight, linear


@dataclass
class MlpWeights:
    gate: torch.Tensor | Fp8Weight  # [I/tp, hidden] (FP8 where vLLM's numerics keep it so)
    up: torch.Tensor | Fp8Weight  # [I/tp, hidden]
    down: torch.Tensor | Fp8Weight  # [hidden, I/tp]


@dataclass
class Fp8Experts:
    """One projection of every routed expert kept in FP8 with its block scales: an expert's weight is dequantized
    when a step uses it. Routed experts are nearly all of a GLM-5.3-Flash checkpoint's bytes, so they stay at one
    byte a weight (docs/glm5.md, "Memory"); indexing gives expert e's [rows, cols] weight in the run's dtype."""

    q: torch.Tensor  # [E, rows, cols] float8_e4m3fn
    scale: torch.Tensor  # [E, ceil(rows/bo), ceil(cols/bi)] float32
    block: tuple[int, int]
    dtype: torch.dtype  # the run's
    # vLLM's fused MoE (numerics vllm): each expert's GEMM quantizes its input per token and group (fp8_linear);
    # else the expert's weight is dequantized to the run's dtype and its input taken as it is
    fp8_gemm: bool = False
    act_ue8m0: bool = False  # power-of-two activation scales (vLLM on Hopper with DeepGEMM's E8M0 on)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def __getitem__(self, e: int) -> torch.Tensor | Fp8Weight:
        if self.fp8_gemm:
            return Fp8Weight(self.q[e], self.scale[e], self.block, self.act_ue8m0)
        return dequantize(self.q[e], self.scale[e], self.block, self.dtype)


@dataclass
class MoeWeights:
    router: torch.Tensor  # [E, hidden] (accumulation dtype)
    bias: torch.Tensor  # [E] e_score_correction_bias: steers the choice, not the weights
    gate: torch.Tensor | Fp8Experts  # [E, Im/tp, hidden]
    up: torch.Tensor | Fp8Experts  # [E, Im/tp, hidden]
    down: torch.Tensor | Fp8Experts  # [E, hidden, Im/tp]
    shared: MlpWeights | None  # None when n_shared_experts == 0
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): the gate is clamped from above only."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def mlp(w: MlpWeights, x: torch.Tensor, limit: float) -> torch.Tensor:
    """Dense clamped-SwiGLU MLP: [T, hidden] -> this rank's partial [T, hidden]."""
    return linear(swiglu(linear(x, w.gate), linear(x, w.up), limit), w.down)


def route(w: MoeWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of x [T, hidden]: (weights [T, top_k] accumulation dtype, expert ids [T, top_k])."""
    scores = torch.sigmoid(F.linear(x.to(w.router.dtype), w.router))  # [T, E]
    choice = scores + w.bias
    T, E = choice.shape
    grouped = choice.view(T, w.n_group, E // w.n_group)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)  # a group is as good as its two best experts
    groups = group_score.topk(w.topk_group, dim=-1).indices
    allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~allowed.repeat_interleave(E // w.n_group, dim=1), float("-inf"))
    ids = choice.topk(w.top_k, dim=-1).indices
    weights = scores.gather(1, ids)  # the unbiased scores weight the experts
    if w.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * w.routed_scaling_factor, ids


def moe(w: MoeWeights, x: torch.Tensor, limit: float) -> torch.Tensor:
    """Routed experts plus shared experts: [T, hidden] -> this rank's partial [T, hidden]."""
    weights, ids = route(w, x)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    out = (every_expert if capturing else experts_hit)(w, x, weights, ids, limit)
    if w.shared is not None:
        out = out + mlp(w.shared, x, limit)
    return out


def experts_hit(w: MoeWeights, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float) -> torch.Tensor:
    """Each expert some token chose, on those tokens: the host reads which experts were hit (a device sync)."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = swiglu(linear(x[tok], w.gate[e]), linear(x[tok], w.up[e]), limit)
        y = linear(h, w.down[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def every_expert(w: MoeWeights, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float) -> torch.Tensor:
    """Every expert on every token, scaled by its routing weight (0 where not chosen): no host reads, so a CUDA
    graph can hold it, at E / top_k times the expert FLOPs. Sums in the same expert order as experts_hit."""
    combine = torch.zeros(x.shape[0], w.gate.shape[0], dtype=weights.dtype, device=x.device).scatter_add_(1, ids, weights)
    out = torch.zeros_like(x)
    for e in range(w.gate.shape[0]):
        h = swiglu(linear(x, w.gate[e]), linear(x, w.up[e]), limit)
        out += (linear(h, w.down[e]) * combine[:, e, None]).to(out.dtype)
    return out
