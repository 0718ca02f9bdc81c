"""Kernel backends, chosen by name in the engine config; the runtime is correct without any of them.

A backend names its parts, joined by "+": `compiled` (torch.compile of the decode step before graph
capture), `triton-gemm` (decode projections of <= 16 rows through the split-K Triton kernel),
`triton-attention` (the target's decode attention read in place from the paged store) and `fused`
(one-token target decode steps through one persistent kernel for all layers). `pytorch` (the default) is
none of them: PyTorch operators only (`reference`, its earlier name, is still read). Each part says which steps it
serves; the capture record carries that, so a step a part cannot serve is visible there, never a silent fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

from qual.errors import QualError

PYTORCH = "pytorch"  # no kernel of qual's own: PyTorch operators, eager or replayed in CUDA graphs
_OLD_NAMES = {"reference": PYTORCH}  # names profiles and commands recorded before
PARTS = ("compiled", "compiled-autotune", "triton-gemm", "triton-attention", "fused")
COMPILE_MODES = {"compiled": "default", "compiled-autotune": "max-autotune-no-cudagraphs"}  # modes that leave graphs to us
# What each part serves: every step the runtime runs is a prefill, a plain decode step or a spec-decode step
# (draft + verify of K+1 tokens).
SERVES = {
    "compiled": "decode and spec-decode steps (graph-shaped; prefill stays eager)",
    "compiled-autotune": "decode and spec-decode steps (graph-shaped; prefill stays eager)",
    "triton-gemm": "projections of <= 16 rows (decode at small batch); larger products use torch's GEMM",
    "triton-attention": "the target's attention in decode and verify steps; prefill and draft attention stay PyTorch",
    "fused": "one-token target decode steps (batch 1, no drafter); verify, draft and prefill steps use the per-layer "
             "path (with compiled: the step around the kernel is compiled, the kernel launched as it is)",
}


@dataclass(frozen=True)
class Backend:
    """The kernel choices of one engine."""

    name: str
    parts: tuple[str, ...] = ()

    @property
    def compile_mode(self) -> str | None:
        return next((COMPILE_MODES[p] for p in self.parts if p in COMPILE_MODES), None)

    @property
    def triton_gemm(self) -> bool:
        return "triton-gemm" in self.parts

    @property
    def triton_attention(self) -> bool:
        return "triton-attention" in self.parts

    @property
    def fused_decode(self) -> bool:
        return "fused" in self.parts

    def check(self, device: str, dtype: str, tp: int) -> None:
        """Refuse a backend that cannot run here, before any process starts."""
        gpu_only = [p for p in self.parts if p not in COMPILE_MODES]  # torch.compile also runs on the CPU
        if gpu_only and device == "cpu":
            raise QualError(f"backend {self.name}: {', '.join(gpu_only)} need device cuda (got cpu)")
        triton = [p for p in self.parts if p.startswith("triton-")]
        if triton and dtype not in ("bfloat16", "float16"):
            raise QualError(f"backend {self.name}: {', '.join(triton)} need dtype bfloat16 or float16 (got {dtype})")
        if self.fused_decode and dtype == "float64":
            raise QualError(f"backend {self.name}: fused needs dtype bfloat16, float16 or float32 (got {dtype})")
        if self.fused_decode and tp > 1:
            raise QualError(f"backend {self.name}: fused needs tp 1 (got tp {tp})")

    def linear(self):
        """The projections' GEMM."""
        if not self.triton_gemm:
            import torch.nn.functional as F  # here: naming a backend (a profile's check) needs no torch

            return F.linear
        from qual.runtime.backends import skinny_gemm

        _need_triton(skinny_gemm.available())
        return skinny_gemm.linear

    def paged_attention(self):
        """The target's decode attention over the paged store, or None (gather the keys, then PyTorch)."""
        if not self.triton_attention:
            return None
        from qual.runtime.backends import paged_attention

        _need_triton(paged_attention.triton is not None)
        return paged_attention.paged_attention_op

    def record(self) -> dict:
        """What the capture record says about this backend: its parts and the steps each serves."""
        return {"name": self.name, "serves": {p: SERVES[p] for p in self.parts} or {PYTORCH: "every step"}}


def _need_triton(ok: bool) -> None:
    if not ok:
        raise QualError("this backend needs Triton, which is not installed (CUDA builds of torch ship it)")


def parse_backend(name: str) -> Backend:
    """`pytorch` or parts joined by '+' (e.g. `compiled+triton-gemm+triton-attention`)."""
    name = _OLD_NAMES.get(name, name)
    if name == PYTORCH:
        return Backend(name)
    parts = tuple(name.split("+"))
    unknown = [p for p in parts if p not in PARTS]
    if unknown or len(set(parts)) != len(parts) or not parts:
        raise QualError(f"backend {name!r}: expected {PYTORCH!r} or parts joined by '+' from {', '.join(PARTS)}")
    if sum(p in COMPILE_MODES for p in parts) > 1:
        raise QualError(f"backend {name!r}: at most one of {', '.join(COMPILE_MODES)}")
    return Backend(name, parts)
