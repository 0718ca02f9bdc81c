"""One-token target decode steps through one persistent kernel for all layers (the `fused` backend part).

The kernel reads the target's stacked layer weights (qual/runtime/models/layers.py StackedLayers) in
place, plus one copy of its own: the down projections transposed, so that a program's slice of them is
contiguous. Steps with more than one token (prefill, a drafter's verify block, batches) keep the
per-layer path, as the backend's capture record says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qual.errors import QualError
from qual.runtime.backends.decode_layers import StackedWeights, Tiling, decode_layers


class FusedDecode:
    """The target's decode step for one token: decode_layers, then the caller's final norm."""

    def __init__(self, target, programs: int | None = None, sync: bool = True):
        """programs: one per SM by default (all must be resident at once); sync=False launches phase by
        phase (Triton's interpreter on the CPU, where programs run one after another)."""
        t, stack = target, target.stacked
        lay, cfg = t.layout, t.cfg
        self.programs = programs or torch.cuda.get_device_properties(t.comm.device).multi_processor_count
        self.tiling = Tiling.for_shape(self.programs, cfg.hidden_size, cfg.intermediate_size,
                                       (lay.num_heads + 2 * lay.num_kv_heads) * lay.head_dim, lay.num_kv_heads, lay.head_dim)
        problem = self.tiling.too_big(cfg.hidden_size)
        if problem or self.programs < lay.num_kv_heads:  # checked before any weight is moved
            raise QualError(f"fused_decode: {problem or f'{self.programs} SMs < {lay.num_kv_heads} KV heads'}")
        self.target, self.sync = t, sync
        self.weights = StackedWeights(
            ln1=stack.input_norm, ln2=stack.post_norm, qkv=stack.qkv, q_norm=stack.q_norm, k_norm=stack.k_norm,
            o=stack.o, gate_up=stack.gate_up, down_t=stack.down.transpose(1, 2).contiguous(),
            num_heads=t.layout.num_heads, num_kv_heads=t.layout.num_kv_heads, head_dim=t.layout.head_dim)
        self.flags = None  # the last launch's [barrier arrivals, timeouts so far]
        self.timeouts = torch.zeros(1, dtype=torch.int32, device=t.comm.device)  # sticky across steps and graph replays
        cuda = t.comm.device.type == "cuda"
        self._seen = torch.zeros(1, dtype=torch.int32, pin_memory=True) if cuda else None  # check()'s copy of it
        self._copied = torch.cuda.Event() if cuda else None
        self._started = False

    def applies(self, tokens: torch.Tensor, meta) -> bool:
        return tokens.numel() == 1 and meta.dense and not self.target.aux_layer_ids

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, view, store) -> torch.Tensor:
        """Residual stream after the last layer, float32 [1, hidden] (view: the target group's AttentionView)."""
        x = F.embedding(tokens, self.target.embed)[0]
        return self._layers(x, positions, view.write_slots, view.keys.slots[0], view.mask[0, 0], store)[None]

    @torch.compiler.disable
    def _layers(self, x, positions, write_slots, key_slots, mask, store) -> torch.Tensor:
        """The kernel launch, left out of a compiled step (fused+compiled): torch.compile compiles the step's views,
        final norm, LM head and choices around it, and launches this kernel as it is between them."""
        t = self.target
        out, self.flags = decode_layers(
            x, positions, write_slots, key_slots, mask, self.weights, store.k_all, store.v_all, t.rope.inv_freq,
            t.cfg.rms_norm_eps, t.scale, self.programs, self.tiling, sync=self.sync, timeouts=self.timeouts)
        return out

    def check(self, wait: bool = False) -> None:
        """Raise if a grid barrier ever gave up waiting (its step's results are wrong): the kernel needs every
        SM to itself, so another process's kernels on the same GPU can starve it.

        The count is sticky on the device, so a step need not wait for its own kernel to check it: on CUDA each call
        reads the copy the call before started, if it has landed, and starts the next; wait (the end of a generate
        call) reads the count as it is now."""
        if self._seen is None:  # Triton's interpreter on the CPU: the count is here already
            self._raise_if(int(self.timeouts.item()))
            return
        if self._started and self._copied.query():
            self._raise_if(int(self._seen[0]))
        self._seen.copy_(self.timeouts, non_blocking=True)
        self._copied.record()
        self._started = True
        if wait:
            self._copied.synchronize()
            self._raise_if(int(self._seen[0]))

    @staticmethod
    def _raise_if(timeouts: int) -> None:
        if timeouts:
            raise QualError("fused_decode: a grid barrier timed out (all programs must be resident at once: "
                            "is another process using this GPU?); its decode steps are wrong")