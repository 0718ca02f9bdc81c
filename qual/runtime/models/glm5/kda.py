"""KDA (Kimi delta attention) linear-attention layers: short convolutions, gated delta rule, gated RMSNorm.

Layout: a batch of R requests with the same number T of new tokens, x [R, T, hidden]. A prefill of
requests of different lengths runs request by request (R = 1). This rank holds H = linear_num_heads / tp
heads of D = linear_head_dim (key and value dims are both D); the output is this rank's row-parallel
partial of o_proj (sum over TP ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KdaWeights:
    """One KDA layer, this TP rank's heads."""

    qkv: torch.Tensor  # [3*H*D, hidden]: q rows, then k rows, then v rows
    conv: torch.Tensor  # [3*H*D, K] depthwise causal kernels, same channel order (accumulation dtype)
    f_a: torch.Tensor  # [D, hidden] forget-gate down projection (replicated: every head reads it)
    f_b: torch.Tensor  # [H*D, D]
    dt_bias: torch.Tensor  # [H*D] (accumulation dtype)
    a_log: torch.Tensor  # [H] (accumulation dtype)
    b: torch.Tensor  # [H, hidden] beta projection
    g_a: torch.Tensor  # [D, hidden] output-gate down projection (replicated)
    g_b: torch.Tensor  # [H*D, D]
    o_norm: torch.Tensor  # [D] gated RMSNorm weight
    o_proj: torch.Tensor  # [hidden, H*D] row-parallel
    num_heads: int
    head_dim: int
    lower_bound: float | None  # None: the softplus decay form
    eps: float

    @property
    def acc(self) -> torch.dtype:
        return self.a_log.dtype


@dataclass
class KdaState:
    """Per-request KDA state; per-position states carry an extra [Q] dim after R."""

    conv: torch.Tensor  # [R, 3*H*D, K-1]: the last K-1 projected inputs, oldest first (model dtype)
    recurrent: torch.Tensor  # [R, H, D, D]: delta-rule state, key dim x value dim (accumulation dtype)


def kda_zero_state(w: KdaWeights, batch: int, dtype: torch.dtype, device=None) -> KdaState:
    """The state before a request's first token."""
    C, K, H, D = w.conv.shape[0], w.conv.shape[1], w.num_heads, w.head_dim
    return KdaState(torch.zeros(batch, C, K - 1, dtype=dtype, device=device),
                    torch.zeros(batch, H, D, D, dtype=w.acc, device=device))


def kda_state_at(states: KdaState, index: torch.Tensor) -> KdaState:
    """From per-position states [R, Q, ...], the state after position index[r] of each request."""
    r = torch.arange(index.shape[0], device=index.device)
    return KdaState(states.conv[r, index], states.recurrent[r, index])


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # eps inside the square root (FLA's form, which transformers follows), not F.normalize's clamp
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _forget_gate(w: KdaWeights, x: torch.Tensor) -> torch.Tensor:
    """Per-channel log decay [R, T, H, D] (<= 0)."""
    R, T, _ = x.shape
    g = (F.linear(F.linear(x, w.f_a), w.f_b).to(w.acc) + w.dt_bias).view(R, T, w.num_heads, w.head_dim)
    rate = torch.exp(w.a_log)[:, None]  # [H, 1]
    if w.lower_bound is not None:
        return w.lower_bound * torch.sigmoid(rate * g)  # bounded: decay per step >= exp(lower_bound)
    return -rate * F.softplus(g, threshold=20.0)


def _inputs(w: KdaWeights, x: torch.Tensor, conv_state: torch.Tensor):
    """Projections, convolution and gates; also the convolution window of every new position."""
    R, T, _ = x.shape
    H, D, acc = w.num_heads, w.head_dim, w.acc
    mixed = F.linear(x, w.qkv).transpose(1, 2)  # [R, C, T]
    full = torch.cat([conv_state.to(mixed.dtype), mixed], dim=-1).to(acc)  # [R, C, K-1+T]
    windows = full.unfold(-1, w.conv.shape[1], 1)  # [R, C, T, K]: inputs t-K+1 .. t
    conv = F.silu((windows * w.conv[None, :, None, :]).sum(-1)).to(x.dtype)  # [R, C, T]
    q, k, v = conv.transpose(1, 2).reshape(R, T, 3, H, D).unbind(2)  # each [R, T, H, D]
    q = _l2norm(q.to(acc)) * D**-0.5
    k = _l2norm(k.to(acc))
    beta = torch.sigmoid(F.linear(x, w.b)).to(acc)  # [R, T, H]
    return q, k, v.to(acc), _forget_gate(w, x), beta, windows


def _output(w: KdaWeights, x: torch.Tensor, core: torch.Tensor) -> torch.Tensor:
    """Gated RMSNorm of the core output [R, T, H, D] (float statistics), then o_proj."""
    R, T, _ = x.shape
    gate = F.linear(F.linear(x, w.g_a), w.g_b).view(R, T, w.num_heads, w.head_dim)
    o = core.to(x.dtype).to(w.acc)  # transformers rounds the core output to the model dtype first
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + w.eps) * w.o_norm.to(w.acc)
    o = (o * torch.sigmoid(gate.to(w.acc))).to(x.dtype)
    return F.linear(o.reshape(R, T, -1), w.o_proj)


def delta_rule_steps(q, k, v, g, beta, state):
    """Token by token: q, k, g [R, T, H, D], v [R, T, H, Dv], beta [R, T, H], state [R, H, D, Dv].

    Returns the outputs [R, T, H, Dv] and the state after every position [R, T, H, D, Dv].
    """
    outs, states = [], []
    S = state
    for t in range(q.shape[1]):
        S = S * torch.exp(g[:, t])[..., None]
        recalled = (k[:, t, :, :, None] * S).sum(-2)  # [R, H, Dv]: what S already maps k_t to
        u = beta[:, t, :, None] * (v[:, t] - recalled)
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append((q[:, t, :, :, None] * S).sum(-2))
        states.append(S)
    return torch.stack(outs, 1), torch.stack(states, 1)


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence a chunk at a time; returns outputs [R, T, H, Dv] and the final state.

    Within a chunk, with G the cumulative log decay, S_i = diag(e^G_i) S_0 + sum_{j<=i} diag(e^(G_i-G_j)) k_j u_j^T
    and the updates u solve the unit lower-triangular system (I + M) u = beta (v - (e^G k) S_0),
    M_ij = beta_i k_i^T diag(e^(G_i-G_j)) k_j for j < i. Decays are formed as differences, never e^-G.
    """
    R, T, H, D = k.shape
    pad = (-T) % chunk
    # Padded steps have k = v = beta = g = 0: they change nothing.
    q, k, v, g = (F.pad(t.transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v, g))  # [R, H, T', D]
    beta = F.pad(beta.transpose(1, 2), (0, pad))  # [R, H, T']
    C = chunk
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), -1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    S, outs = state, []
    for c in range(0, T + pad, C):
        qc, kc, vc, gc, bc = q[:, :, c:c + C], k[:, :, c:c + C], v[:, :, c:c + C], g[:, :, c:c + C], beta[:, :, c:c + C]
        G = gc.cumsum(-2)  # [R, H, C, D]
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [R, H, C(i), C(j), D]
        decay = torch.exp(diff.masked_fill(~lower[:, :, None], float("-inf")))  # e^(G_i - G_j), 0 for j > i
        kk = torch.einsum("rhid,rhjd,rhijd->rhij", kc, kc, decay) * bc[..., None]
        A = eye + kk.masked_fill(~strict, 0.0)
        rhs = bc[..., None] * (vc - (torch.exp(G) * kc) @ S)
        u = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [R, H, C, Dv]
        qk = torch.einsum("rhid,rhjd,rhijd->rhij", qc, kc, decay)
        outs.append((torch.exp(G) * qc) @ S + qk @ u)
        last = G[:, :, -1:, :]  # [R, H, 1, D]
        S = torch.exp(last).transpose(-1, -2) * S + (torch.exp(last - G) * kc).transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :T].transpose(1, 2)  # [R, T, H, Dv]
    return out, S


def kda_prefill(w: KdaWeights, x: torch.Tensor, state: KdaState, chunk_size: int = 64):
    """x [R, T, hidden] after `state` -> (partial output [R, T, hidden], state after the T tokens)."""
    q, k, v, g, beta, windows = _inputs(w, x, state.conv)
    core, S = delta_rule_chunked(q, k, v, g, beta, state.recurrent, chunk_size)
    conv_state = windows[:, :, -1, 1:].to(x.dtype)  # [R, C, K-1]: the inputs of the last K-1 positions
    return _output(w, x, core), KdaState(conv_state, S)


def kda_verify(w: KdaWeights, x: torch.Tensor, state: KdaState):
    """x [R, Q, hidden] -> (partial output [R, Q, hidden], state after each position: conv [R, Q, C, K-1],
    recurrent [R, Q, H, D, D]); a speculative verify commits the one after its last accepted token."""
    q, k, v, g, beta, windows = _inputs(w, x, state.conv)
    core, states = delta_rule_steps(q, k, v, g, beta, state.recurrent)
    conv_states = windows[:, :, :, 1:].permute(0, 2, 1, 3).to(x.dtype)  # [R, Q, C, K-1]
    return _output(w, x, core), KdaState(conv_states, states)
