"""Kernel backends, chosen by name in the engine config; the runtime is correct without any of them.

A backend names its parts, joined by "+": `compiled` (torch.compile of the decode step before graph
capture), `compiled-prefill` (torch.compile of the padded prefill too, before its buckets are captured),
`triton-gemm` (decode projections of <= 16 rows through the split-K Triton kernel),
`triton-attention` (the target's decode attention read in place from the paged store), `fused-layer` (a Qwen3
target's decode and verify layers of <= 16 rows as four products that finish their own output: the input RMSNorm,
q/k norm, RoPE and the KV write in the qkv product, the residual in o and down, SwiGLU in gate/up;
qual/runtime/backends/fused_layer.py), `gluon-layer` (the same four products in Gluon, the weight streamed by TMA
through a producer warp's ring: qual/runtime/backends/gluon_layer.py; one of fused-layer and gluon-layer), `fused`
(one-token target decode steps through one persistent kernel for all layers) and `pdl` (the step's Triton
kernels, compiled ones too, launched with programmatic dependent launch: each may start while the one before
finishes). `pytorch` (the default) is
none of them: PyTorch operators only (`reference`, its earlier name, is still read). Each part says which steps it
serves; the capture record carries that, so a step a part cannot serve is visible there, never a silent fallback.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from qual.errors import QualError

PYTORCH = "pytorch"  # no kernel of qual's own: PyTorch operators, eager or replayed in CUDA graphs
_OLD_NAMES = {"reference": PYTORCH}  # names profiles and commands recorded before
PARTS = ("compiled", "compiled-autotune", "compiled-prefill", "triton-gemm", "triton-attention", "fused-layer",
         "gluon-layer", "fused", "pdl")
# tensor-core products of bf16 or fp16 tiles
HALF_PRECISION_PARTS = ("triton-gemm", "triton-attention", "fused-layer", "gluon-layer")
LAYER_PARTS = ("fused-layer", "gluon-layer")  # a Qwen3 target's decode layers as four products: at most one
ATTENTION_PARTS = ("triton-attention", "fused")  # parts that compute the target's attention in a kernel of their own
COMPILE_MODES = {"compiled": "default", "compiled-autotune": "max-autotune-no-cudagraphs"}  # modes that leave graphs to us
# What each part serves: every step the runtime runs is a prefill, a plain decode step or a spec-decode step
# (draft + verify of K+1 tokens).
SERVES = {
    "compiled": "decode and spec-decode steps (graph-shaped; prefill stays eager)",
    "compiled-autotune": "decode and spec-decode steps (graph-shaped; prefill stays eager)",
    "compiled-prefill": "prefill at padded shapes (the buckets of qual/runtime/prefill_graphs.py), in the compile "
                        "mode of compiled or compiled-autotune where named (else compiled's); chunks too large for a "
                        "bucket stay eager",
    "triton-gemm": "projections of <= 16 rows (decode at small batch); larger products use torch's GEMM",
    "triton-attention": "the target's attention in decode and verify steps; prefill and draft attention stay PyTorch",
    "fused-layer": "the Qwen3 target's layers in decode and verify steps of <= 16 rows (tp 1): four products a layer "
                   "that finish their own output, attention between them as the other parts choose; prefill, larger "
                   "steps, the drafter and the LM head use the per-layer path",
    "gluon-layer": "as fused-layer, the products in Gluon (TMA weight ring, compute capability >= 9.0; head_dim 64 "
                   "or 128): the gate/up weight read in place (no second copy); the o and down products also write "
                   "the residual times the next norm's weight, one [rows, hidden] tensor more each, and the first "
                   "layer's is one elementwise kernel before it",
    "fused": "one-token target decode steps (batch 1, no drafter); verify, draft and prefill steps use the per-layer "
             "path (with compiled: the step around the kernel is compiled, the kernel launched as it is)",
    "pdl": "the Triton kernels of decode and spec-decode steps (triton-gemm, triton-attention, fused-layer or "
           "gluon-layer, and the "
           "compiled step's "
           "own; with compiled-prefill, the compiled prefill's too) launched with programmatic dependent launch; "
           "cuBLAS and PyTorch's kernels wait as before",
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
    def compile_prefill(self) -> bool:
        return "compiled-prefill" in self.parts

    @property
    def compiles(self) -> bool:
        """Whether any step runs through torch.compile (its compiled entries then belong to this engine)."""
        return self.compile_mode is not None or self.compile_prefill

    @property
    def triton_gemm(self) -> bool:
        return "triton-gemm" in self.parts

    @property
    def triton_attention(self) -> bool:
        return "triton-attention" in self.parts

    @property
    def layer_part(self) -> str | None:
        """The part that runs a Qwen3 target's decode layers as four products (LAYER_PARTS), or None."""
        return next((p for p in self.parts if p in LAYER_PARTS), None)

    @property
    def fused_decode(self) -> bool:
        return "fused" in self.parts

    @property
    def pdl(self) -> bool:
        return "pdl" in self.parts

    def check(self, device: str, dtype: str, tp: int) -> None:
        """Refuse a backend that cannot run here, before any process starts."""
        # torch.compile also runs on the CPU
        gpu_only = [p for p in self.parts if p not in COMPILE_MODES and p != "compiled-prefill"]
        if gpu_only and device == "cpu":
            raise QualError(f"backend {self.name}: {', '.join(gpu_only)} need device cuda (got cpu)")
        triton = [p for p in self.parts if p in HALF_PRECISION_PARTS]
        if triton and dtype not in ("bfloat16", "float16"):
            raise QualError(f"backend {self.name}: {', '.join(triton)} need dtype bfloat16 or float16 (got {dtype})")
        if self.fused_decode and dtype == "float64":
            raise QualError(f"backend {self.name}: fused needs dtype bfloat16, float16 or float32 (got {dtype})")
        if self.fused_decode and tp > 1:
            raise QualError(f"backend {self.name}: fused needs tp 1 (got tp {tp})")
        if self.layer_part and tp > 1:  # the residual is added inside the o and down products, before any all-reduce
            raise QualError(f"backend {self.name}: {self.layer_part} needs tp 1 (got tp {tp})")
        if self.pdl and not (set(self.parts) & {"compiled", "compiled-autotune", "compiled-prefill", "triton-gemm",
                                                "triton-attention", *LAYER_PARTS}):
            raise QualError(f"backend {self.name}: pdl launches the Triton kernels of compiled, compiled-prefill, "
                            "triton-gemm, triton-attention, fused-layer or gluon-layer; name at least one of them")

    def check_device(self, device) -> None:
        """Refuse, once the device is known, a part this GPU or this Triton cannot run."""
        hopper = [p for p in self.parts if p in ("pdl", "gluon-layer")]  # PTX of sm_90 on: griddepcontrol, TMA, wgmma
        if not hopper:
            return
        import torch

        from qual.runtime.backends import skinny_gemm

        if torch.cuda.get_device_capability(device) < (9, 0):
            raise QualError(f"backend {self.name}: {', '.join(hopper)} need a GPU of compute capability 9.0 or later "
                            f"(got {torch.cuda.get_device_name(device)})")
        if "gluon-layer" in self.parts:
            from qual.runtime.backends import gluon_gemm  # its Gluon imports only where the part is named

            if not gluon_gemm.available():
                raise QualError(f"backend {self.name}: gluon-layer needs Triton {gluon_gemm.GLUON_TRITON}x with "
                                "Gluon (the kernels are written against its API)")
        if self.pdl and not skinny_gemm.pdl_available():
            raise QualError(f"backend {self.name}: pdl needs a Triton with programmatic dependent launch "
                            "(triton.language.extra.cuda.gdc_wait)")

    def linear(self):
        """The projections' GEMM."""
        if not self.triton_gemm:
            import torch.nn.functional as F  # here: naming a backend (a profile's check) needs no torch

            return F.linear
        from qual.runtime.backends import skinny_gemm

        _need_triton(skinny_gemm.available())
        return functools.partial(skinny_gemm.linear, pdl=True) if self.pdl else skinny_gemm.linear

    def paged_attention(self):
        """The target's decode attention over the paged store, or None (gather the keys, then PyTorch)."""
        if not self.triton_attention:
            return None
        from qual.runtime.backends import paged_attention

        _need_triton(paged_attention.triton is not None)
        op = paged_attention.paged_attention_op
        return functools.partial(op, pdl=True) if self.pdl else op

    def layer_products(self, hidden: int, intermediate: int, layout, eps: float, device):
        """fused-layer's or gluon-layer's products for a Qwen3 target of this shape (layout: this rank's
        HeadLayout); each refuses by name a machine without the Triton it needs."""
        if self.layer_part == "gluon-layer":
            from qual.runtime.backends.gluon_layer_products import GluonLayerProducts as products
        else:
            from qual.runtime.backends.layer_products import LayerProducts as products
        return products(hidden, intermediate, layout.num_heads, layout.num_kv_heads, layout.head_dim, eps, device,
                        pdl=self.pdl)

    def compile(self, fn, dynamic: bool | None = False):
        """torch.compile'd fn (compile_mode): with dynamic False one specialised graph per padded batch size (as the
        CUDA graphs are); with None, shapes that change between calls become symbolic at their second value, so
        a few compiles serve every prefill bucket (dynamic=True, symbolic from the first call, traced the toy target's
        prefill without its aux features under torch 2.13: they came back None, and the drafter's context failed).
        With pdl, inductor's Triton kernels launch with programmatic dependent launch (each waits for the kernel
        before it where it first reads or writes memory).

        Dynamo keeps compiled entries per code object, across runners, and past its limit (8) would
        silently run the rest uncompiled: raise the limit and make hitting it an error instead.
        """
        import torch

        dyn = torch._dynamo.config
        dyn.recompile_limit = max(dyn.recompile_limit, 64)
        if hasattr(dyn, "fail_on_recompile_limit_hit"):
            dyn.fail_on_recompile_limit_hit = True
        mode = self.compile_mode or COMPILE_MODES["compiled"]
        if not self.pdl:
            return torch.compile(fn, mode=mode, dynamic=dynamic)
        import torch._inductor.config as inductor_config

        if not hasattr(inductor_config.triton, "enable_pdl"):
            raise QualError(f"backend {self.name}: this torch ({torch.__version__}) cannot launch compiled kernels "
                            "with programmatic dependent launch (no torch._inductor.config.triton.enable_pdl)")
        # torch.compile takes a mode or options, not both: the mode's options plus PDL
        options = {**torch._inductor.list_mode_options(mode), "triton.enable_pdl": True}
        return torch.compile(fn, options=options, dynamic=dynamic)

    def record(self) -> dict:
        """What the capture record says about this backend: its parts and the steps each serves."""
        return {"name": self.name, "serves": {p: SERVES[p] for p in self.parts} or {PYTORCH: "every step"}}


def part_problems(device: str) -> dict[str, str | None]:
    """Each part's problem on this machine's `device` ("cuda": GPU 0, or "cpu"), None where it can run: the checks a
    run makes (Backend.check, and check_device on a GPU) on the smallest backend naming the part, in bfloat16 on one
    rank, and whether the Triton its kernels need is installed (qual doctor)."""
    from qual.runtime.backends import skinny_gemm

    companion = {"pdl": "triton-gemm+pdl"}  # parts that need another
    problems = {}
    for part in PARTS:
        backend = parse_backend(companion.get(part, part))
        try:
            backend.check(device, "bfloat16", 1)  # on the CPU: refuses every part but torch.compile's
            if device == "cuda":  # every part runs Triton's kernels there: its own, or inductor's
                import torch

                _need_triton(skinny_gemm.available())
                backend.check_device(torch.device("cuda", 0))
        except QualError as exc:
            problems[part] = str(exc)
        except Exception as exc:  # noqa: BLE001 - e.g. a GPU whose driver fails the query: doctor reports, never dies
            problems[part] = f"{type(exc).__name__}: {exc}"
        else:
            problems[part] = None
    return problems


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
    if sum(p in LAYER_PARTS for p in parts) > 1:
        raise QualError(f"backend {name!r}: at most one of {', '.join(LAYER_PARTS)}")
    return Backend(name, parts)
