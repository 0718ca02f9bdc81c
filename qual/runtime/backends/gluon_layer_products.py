"""The gluon-layer backend part's model-facing side: its products as custom ops, and GluonLayerProducts, which a
Qwen3 target's decode layer calls as it calls fused-layer's LayerProducts (qual/runtime/models/qwen3.py,
Qwen3Target._fused_layer). The kernels: qual/runtime/backends/gluon_layer.py.

The one difference in the layer's data: the normed products stream x * ln, which the residual product before them
wrote beside the residual (gluon_layer's docstring), so o and mlp return (residual, residual * the next norm's
weight) and qkv and mlp take that second tensor; the first layer's comes from `enter`.
"""

from __future__ import annotations

import math

import torch

from qual.errors import QualError
from qual.runtime.backends import gluon_gemm
from qual.runtime.backends.layer_products import LayerProducts
from qual.runtime.backends.gluon_layer import qkv_product, residual_product, swiglu_product

HEAD_DIMS = (64, 128)  # a head is one column block of the qkv product: a multiple of the 64 rows a warp group
# multiplies, within two programs an SM's shared memory (tests/test_kernels_compile.py compiles both)


def shape_problem(hidden: int, intermediate: int, heads: int, head_dim: int) -> str | None:
    """Why the gluon-layer products cannot take a Qwen3 target of this shape, or None: TMA reads rows of 16-byte
    multiples (every K: hidden, heads * head_dim, intermediate, of bf16 or fp16), and the qkv product's column block
    is a head."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {', '.join(map(str, HEAD_DIMS))} (a head is one column block)"
    for name, k in (("hidden_size", hidden), ("intermediate_size", intermediate), ("heads x head_dim",
                                                                                   heads * head_dim)):
        if k % 8:
            return f"{name} {k} is not a multiple of 8 (TMA reads rows of 16-byte multiples)"
    return None


if gluon_gemm.gluon is not None:
    # As fused-layer's ops (layer_products.py): each launch one opaque node for torch.compile; the counts come back
    # to zero each launch; the caches are the layer's views, mutated in place.
    @torch.library.custom_op("qual::gluon_layer_qkv", mutates_args=("k_cache", "v_cache"))
    def _qkv_op(x_ln: torch.Tensor, x: torch.Tensor, eps: float, qkv: torch.Tensor, qk_norm: torch.Tensor,
                positions: torch.Tensor, inv_freq: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, heads: int, kv_heads: int, counts: torch.Tensor, pdl: bool) -> torch.Tensor:
        return qkv_product(x_ln, x, eps, qkv, qk_norm, positions, inv_freq, slots, k_cache, v_cache, heads, kv_heads,
                           counts, pdl=pdl)

    @_qkv_op.register_fake
    def _(x_ln, x, eps, qkv, qk_norm, positions, inv_freq, slots, k_cache, v_cache, heads, kv_heads, counts, pdl):
        return x.new_empty(x.shape[0], heads * qk_norm.shape[1])

    @torch.library.custom_op("qual::gluon_layer_residual", mutates_args=())
    def _residual_op(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, counts: torch.Tensor,
                     pdl: bool) -> torch.Tensor:
        return residual_product(x, w, residual, counts, pdl=pdl)[0]

    @_residual_op.register_fake
    def _(x, w, residual, counts, pdl):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.custom_op("qual::gluon_layer_residual_ln", mutates_args=())
    def _residual_ln_op(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, ln_next: torch.Tensor,
                        counts: torch.Tensor, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return residual_product(x, w, residual, counts, ln_next, pdl=pdl)

    @_residual_ln_op.register_fake
    def _(x, w, residual, ln_next, counts, pdl):
        return x.new_empty(x.shape[0], w.shape[0]), x.new_empty(x.shape[0], w.shape[0])

    @torch.library.custom_op("qual::gluon_layer_swiglu", mutates_args=())
    def _swiglu_op(x_ln: torch.Tensor, x: torch.Tensor, eps: float, gate_up: torch.Tensor, counts: torch.Tensor,
                   pdl: bool) -> torch.Tensor:
        return swiglu_product(x_ln, x, eps, gate_up, counts, pdl=pdl)

    @_swiglu_op.register_fake
    def _(x_ln, x, eps, gate_up, counts, pdl):
        return x.new_empty(x.shape[0], gate_up.shape[0] // 2)


class GluonLayerProducts:
    """The gluon-layer part for one model: a decode layer's four Gluon products (qkv, o, gate/up, down) and one
    atomic count buffer each (zero between launches; the layers share them, one launch after another)."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 device: torch.device, pdl: bool = False):
        if not gluon_gemm.available():
            raise QualError(f"backend part gluon-layer needs Triton {gluon_gemm.GLUON_TRITON}x with Gluon")
        problem = shape_problem(hidden, intermediate, heads, head_dim)
        if problem:
            raise QualError(f"backend part gluon-layer: {problem}")
        self.heads, self.kv_heads, self.eps, self.pdl = heads, kv_heads, eps, pdl
        column_blocks = lambda n, k: math.ceil(n / gluon_gemm.choose_config(n, k).block_n)  # noqa: E731  as launched
        blocks = {"qkv": heads + 2 * kv_heads, "o": column_blocks(hidden, heads * head_dim),
                  "gate_up": column_blocks(2 * intermediate, hidden), "down": column_blocks(hidden, intermediate)}
        self.counts = {name: torch.zeros(n, dtype=torch.int32, device=device) for name, n in blocks.items()}

    applies = staticmethod(LayerProducts.applies)  # the same steps as fused-layer's

    @staticmethod
    def enter(x: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
        """The first layer's x * ln (later layers' comes from the down product before them): x rounded, then one
        rounding of the float32 product, as the residual products write it."""
        return (x.float() * input_norm.float()).to(x.dtype)

    def qkv(self, x: torch.Tensor, x_ln: torch.Tensor, input_norm: torch.Tensor, attn, positions: torch.Tensor,
            inv_freq: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Roped queries [T, heads * D] of the residual x (x_ln: x * input_norm); k and v written to the layer's
        k/v_cache at slots. attn: layers.AttentionWeights."""
        return torch.ops.qual.gluon_layer_qkv(x_ln, x, self.eps, attn.qkv, attn.qk_norm, positions, inv_freq, slots,
                                              k_cache, v_cache, self.heads, self.kv_heads, self.counts["qkv"],
                                              self.pdl)

    def o(self, attended: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
          post_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual after attention, residual + attended @ o.T, and that times post_norm."""
        return torch.ops.qual.gluon_layer_residual_ln(attended.contiguous(), w, residual, post_norm,
                                                      self.counts["o"], self.pdl)

    def mlp(self, x: torch.Tensor, x_ln: torch.Tensor, post_norm: torch.Tensor, m,
            next_norm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual after the MLP (m: layers.MlpWeights), x + down(SwiGLU(gate_up(RMSNorm(x)))), and that times
        next_norm (the next layer's input norm; None after the last layer)."""
        act = torch.ops.qual.gluon_layer_swiglu(x_ln, x, self.eps, m.gate_up, self.counts["gate_up"], self.pdl)
        if next_norm is None:
            return torch.ops.qual.gluon_layer_residual(act, m.down, x, self.counts["down"], self.pdl), None
        return tuple(torch.ops.qual.gluon_layer_residual_ln(act, m.down, x, next_norm, self.counts["down"], self.pdl))
