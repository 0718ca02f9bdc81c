"""One-token target decode steps through one persistent kernel for all layers (EngineConfig.fused_decode).

Stacks the target's per-layer weights along a layer dimension, once, and rebinds every layer's
tensors as views of the stacks (no second copy). Steps with more than one token (prefill, a
drafter's verify block, batches) keep the per-layer path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qual.errors import QualError
from qual.runtime.kernels.decode_layers import StackedWeights, Tiling, decode_layers


def _stack(layers, path: str, transpose: bool = False) -> torch.Tensor:
    """Stack one weight (path: attribute path in a layer, e.g. "attn.qkv") over the layers, then rebind each
    layer's attribute to its view of the stack, so the per-layer path reads the same memory."""
    *owner, name = path.split(".")
    holders = [functools.reduce(getattr, owner, layer) for layer in layers]
    stacked = torch.stack([(getattr(h, name).t() if transpose else getattr(h, name)).contiguous() for h in holders])
    for h, view in zip(holders, stacked):
        setattr(h, name, view.t() if transpose else view)
    return stacked


class FusedDecode:
    """The target's decode step for one token: decode_layers, then the caller's final norm."""

    def __init__(self, target, programs: int | None = None, sync: bool = True):
        """programs: one per SM by default (all must be resident at once); sync=False launches phase by
        phase (Triton's interpreter on the CPU, where programs run one after another)."""
        t, layers = target, target.layers
        lay, cfg = t.layout, t.cfg
        self.programs = programs or torch.cuda.get_device_properties(t.comm.device).multi_processor_count
        self.tiling = Tiling.for_shape(self.programs, cfg.hidden_size, cfg.intermediate_size,
                                       (lay.num_heads + 2 * lay.num_kv_heads) * lay.head_dim, lay.num_kv_heads, lay.head_dim)
        problem = self.tiling.too_big(cfg.hidden_size)
        if problem or self.programs < lay.num_kv_heads:  # checked before any weight is moved
            raise QualError(f"fused_decode: {problem or f'{self.programs} SMs < {lay.num_kv_heads} KV heads'}")
        self.target, self.sync = t, sync
        self.weights = StackedWeights(
            ln1=_stack(layers, "input_norm"), ln2=_stack(layers, "post_norm"), qkv=_stack(layers, "attn.qkv"),
            q_norm=_stack(layers, "attn.q_norm"), k_norm=_stack(layers, "attn.k_norm"), o=_stack(layers, "attn.o"),
            gate_up=_stack(layers, "mlp.gate_up"), down_t=_stack(layers, "mlp.down", transpose=True),
            num_heads=t.layout.num_heads, num_kv_heads=t.layout.num_kv_heads, head_dim=t.layout.head_dim)
        self.flags = None  # the last launch's [barrier arrivals, timeouts so far]
        self.timeouts = torch.zeros(1, dtype=torch.int32, device=t.comm.device)  # sticky across steps and graph replays

    def applies(self, tokens: torch.Tensor, meta) -> bool:
        return tokens.numel() == 1 and meta.dense and not self.target.aux_layer_ids

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, meta, store) -> torch.Tensor:
        """Residual stream after the last layer, float32 [1, hidden]."""
        t = self.target
        out, self.flags = decode_layers(
            F.embedding(tokens, t.embed)[0], positions, meta.write_slots, meta.keys.slots[0], meta.mask[0, 0],
            self.weights, store.k_all, store.v_all, t.rope.inv_freq, t.cfg.rms_norm_eps, t.scale, self.programs,
            self.tiling, sync=self.sync, timeouts=self.timeouts)
        return out[None]

    def check(self) -> None:
        """Raise if a grid barrier ever gave up waiting (its step's results are wrong): the kernel needs every
        SM to itself, so another process's kernels on the same GPU can starve it."""
        if int(self.timeouts.item()):
            raise QualError("fused_decode: a grid barrier timed out (all programs must be resident at once: "
                            "is another process using this GPU?); its decode steps are wrong")
