"""float64 recomputations of the fused-layer products (qual/runtime/backends/fused_layer.py), from their definitions."""

import torch
from dflash_reference import rms  # (x, weight, eps) -> RMSNorm(x) * weight in float64


def qkv(x, ln, eps, w, qk_norm, positions, inv_freq, heads: int, kv_heads: int):
    """(q [M, heads, D], k [M, kv, D], v [M, kv, D]) in float64: RMSNorm, the product, per-head RMSNorm of q and k,
    rotate-half RoPE at each row's position."""
    d = qk_norm.shape[1]
    y = rms(x, ln.double(), eps) @ w.double().T
    y = y.view(x.shape[0], heads + 2 * kv_heads, d)
    qk = rms(y[:, : heads + kv_heads], qk_norm.double(), eps)
    angle = positions.double()[:, None, None] * inv_freq.double()
    lo, hi = qk[..., : d // 2], qk[..., d // 2 :]
    qk = torch.cat([lo * angle.cos() - hi * angle.sin(), hi * angle.cos() + lo * angle.sin()], dim=-1)
    return qk[:, :heads], qk[:, heads:], y[:, heads + kv_heads :]


def swiglu(x, ln, eps, gate_up):
    """silu(gate) * up of RMSNorm(x) * ln, float64 (gate_up: gate rows, then up rows)."""
    gate, up = (rms(x, ln.double(), eps) @ gate_up.double().T).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def residual(x, w, res):
    """res + x @ w.T, float64."""
    return res.double() + x.double() @ w.double().T
