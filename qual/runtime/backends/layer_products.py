"""The fused-layer backend part's model-facing side: its products as custom ops, and LayerProducts, which a Qwen3
target's decode layer calls (qual/runtime/models/qwen3.py, Qwen3Target._fused_layer). The kernels:
qual/runtime/backends/fused_layer.py. Its methods are the ones gluon-layer's GluonLayerProducts has
(gluon_layer_products.py), whose normed products take x * ln from the product before: here that second tensor is
None throughout."""

from __future__ import annotations

import math

import torch

from qual.errors import QualError
from qual.runtime.backends.fused_layer import (MAX_ROWS, qkv_product, residual_config, residual_product,
                                               swiglu_config, swiglu_product, triton)


if triton is not None:
    # As custom ops, torch.compile keeps each launch one opaque node. The counts are not declared mutated: every
    # launch leaves them as it found them (zero), and launches on one stream never overlap. The caches are the
    # layer's views that attention reads next (KVStore.k[i], as KVStore.write mutates them): inductor then calls the
    # op on the store in place, no copy (its output code, docs/PERFORMANCE.md).
    @torch.library.custom_op("qual::fused_layer_qkv", mutates_args=("k_cache", "v_cache"))
    def _qkv_op(x: torch.Tensor, ln: torch.Tensor, eps: float, qkv: torch.Tensor, qk_norm: torch.Tensor,
                positions: torch.Tensor, inv_freq: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, heads: int, kv_heads: int, counts: torch.Tensor, pdl: bool) -> torch.Tensor:
        return qkv_product(x, ln, eps, qkv, qk_norm, positions, inv_freq, slots, k_cache, v_cache, heads, kv_heads,
                           counts, pdl=pdl)

    @_qkv_op.register_fake
    def _(x, ln, eps, qkv, qk_norm, positions, inv_freq, slots, k_cache, v_cache, heads, kv_heads, counts, pdl):
        return x.new_empty(x.shape[0], heads * qk_norm.shape[1])

    @torch.library.custom_op("qual::fused_layer_residual", mutates_args=())
    def _residual_op(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, counts: torch.Tensor,
                     pdl: bool) -> torch.Tensor:
        return residual_product(x, w, residual, counts, pdl=pdl)

    @_residual_op.register_fake
    def _(x, w, residual, counts, pdl):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.custom_op("qual::fused_layer_swiglu", mutates_args=())
    def _swiglu_op(x: torch.Tensor, ln: torch.Tensor, eps: float, gate_up: torch.Tensor, counts: torch.Tensor,
                   pdl: bool) -> torch.Tensor:
        return swiglu_product(x, ln, eps, gate_up, counts, pdl=pdl)

    @_swiglu_op.register_fake
    def _(x, ln, eps, gate_up, counts, pdl):
        return x.new_empty(x.shape[0], gate_up.shape[0] // 2)


class LayerProducts:
    """The fused-layer part for one model: a decode layer's four products (qkv, o, gate/up, down) and one atomic
    count buffer each (zero between launches; the layers share them, one launch after another)."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 device: torch.device, pdl: bool = False):
        if triton is None:
            raise QualError("backend part fused-layer needs Triton, which is not installed")
        if head_dim & (head_dim - 1) or head_dim < 32:
            raise QualError(f"backend part fused-layer: head_dim {head_dim} is not a power of 2 >= 32 (a head is one "
                            "column block of the qkv product)")
        self.heads, self.kv_heads, self.eps, self.pdl = heads, kv_heads, eps, pdl
        nqkv = (heads + 2 * kv_heads) * head_dim
        blocks = {"qkv": nqkv // head_dim,
                  "o": math.ceil(hidden / residual_config(hidden, heads * head_dim).block_n),
                  "gate_up": math.ceil(intermediate / (swiglu_config(2 * intermediate, hidden).block_n // 2)),
                  "down": math.ceil(hidden / residual_config(hidden, intermediate).block_n)}
        self.counts = {name: torch.zeros(n, dtype=torch.int32, device=device) for name, n in blocks.items()}

    @staticmethod
    def applies(rows: int, prefill: bool) -> bool:
        """Decode and verify steps of up to MAX_ROWS rows; prefill and larger steps take the per-layer path."""
        return rows <= MAX_ROWS and not prefill

    @staticmethod
    def enter(x: torch.Tensor, input_norm: torch.Tensor) -> None:
        """What the first layer's products take beside the residual: nothing here (the normed products apply the
        norm's weight at the load; gluon-layer's stream x * ln instead, GluonLayerProducts.enter)."""
        return None

    def qkv(self, x: torch.Tensor, x_ln: None, input_norm: torch.Tensor, attn, positions: torch.Tensor,
            inv_freq: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Roped queries [T, heads * D] of the residual x; k and v written to the layer's k/v_cache [slots, kv heads,
        D] at slots (routed). attn: layers.AttentionWeights."""
        return torch.ops.qual.fused_layer_qkv(x, input_norm, self.eps, attn.qkv, attn.qk_norm, positions, inv_freq,
                                              slots, k_cache, v_cache, self.heads, self.kv_heads, self.counts["qkv"],
                                              self.pdl)

    def o(self, attended: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
          post_norm: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The residual after attention, residual + attended @ o.T (and None: gate/up applies post_norm itself)."""
        return torch.ops.qual.fused_layer_residual(attended, w, residual, self.counts["o"], self.pdl), None

    def mlp(self, x: torch.Tensor, x_ln: None, post_norm: torch.Tensor, m,
            next_norm: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        """The residual after the MLP (m: layers.MlpWeights): x + down(SwiGLU(gate_up(RMSNorm(x)))), and None."""
        act = torch.ops.qual.fused_layer_swiglu(x, post_norm, self.eps, m.gate_up, self.counts["gate_up"], self.pdl)
        return torch.ops.qual.fused_layer_residual(act, m.down, x, self.counts["down"], self.pdl), None
