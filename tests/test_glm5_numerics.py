"""GLM-5.3-Flash as vLLM computes it (qual/runtime/models/glm5/numerics.py, docs/glm5.md "Numerics"), piece by piece
against vLLM 0.32's own code where it runs on this machine, else against float64 recomputations written from its
source:

1. vLLM's torch functions, run by the vLLM CPU build (.venv-vllm, a subprocess): QuantFP8's group quantization
   (float32 and power-of-two scales), requant_weight_ue8m0_inplace, fast_hadamard_transform's butterflies,
   mhc_pre_torch / mhc_post_torch, fp8_paged_mqa_logits_torch, should_use_deepgemm_for_fp8_linear.
2. vLLM's Triton kernels, their source from .venv-vllm run by Triton's interpreter (the CPU build disables Triton):
   fwht128_quant_fp8, the kpool compress kernel, _per_token_group_quant_fp8 (the kernels vLLM runs on GPUs).
3. float64 recomputations: the block W8A8 GEMM, the KDA safe gate.
4. The runtime: which weights stay FP8 under each numerics, the notes on a null linear_lower_bound, and DCP N ==
   DCP 1 under numerics vllm.
Skipped where .venv-vllm is absent (`make vllm-venv`).
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qual.checkpoints.fp8 import quantize
from qual.runtime.models.glm5.dsa import pool_scores
from qual.runtime.models.glm5.mhc import HcWeights, hc_post, hc_pre
from qual.runtime.models.glm5.numerics import (Fp8Weight, deep_gemm_takes, fp8_linear, group_quant_fp8, hadamard,
                                               pool_fp8, requant_ue8m0, rotate_quant_fp8)

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SITE = sorted((REPO / ".venv-vllm" / "lib").glob("python3*/site-packages/vllm"))
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists() or not SITE, reason=".venv-vllm absent: run `make vllm-venv`")

# The vLLM CPU build's side: its functions on the inputs of _inputs(), outputs saved for the test process.
VLLM_SIDE = textwrap.dedent('''
    import sys, torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch, mhc_pre_torch
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.fp8_utils import requant_weight_ue8m0_inplace
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
    from vllm.utils.deep_gemm import should_use_deepgemm_for_fp8_linear
    from vllm.v1.attention.ops.int4_per_token_head import fast_hadamard_transform
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_paged_mqa_logits_torch

    root = sys.argv[1]
    t = torch.load(root + "/inputs.pt")
    out = {}
    with set_current_vllm_config(VllmConfig()):
        for ue8m0 in (False, True):
            q = QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=ue8m0)
            out[f"act_q{int(ue8m0)}"], out[f"act_s{int(ue8m0)}"] = q._quantize_group_native(t["act"])
    w, s = t["w8"].clone(), t["w_scale"].clone()
    requant_weight_ue8m0_inplace(w, s, [128, 128])
    out["requant_w"], out["requant_s"] = w, s
    out["hadamard"] = fast_hadamard_transform(t["h"].clone()) * 0.08838834764831845
    m = t["mhc"]
    out["pre"] = mhc_pre_torch(m["residual"], m["fn"], m["scale"], m["base"], m["rms_eps"], m["eps"], m["eps"], 2.0,
                               m["iters"])
    out["post"] = mhc_post_torch(m["x"], m["residual"], m["post"], m["comb"])
    g = t["logits"]
    P, D = g["k8"].shape
    cache = torch.cat([g["k8"].view(torch.uint8).reshape(1, P * D), g["k_scale"].view(torch.uint8).reshape(1, 4 * P)], 1)
    out["logits"] = torch.stack([fp8_paged_mqa_logits_torch(
        g["q8"][i:i + 1, None], cache.view(1, P, 1, D + 4), g["weights"][i:i + 1], torch.tensor([P]),
        torch.zeros(1, 1, dtype=torch.int32), P)[0] for i in range(g["q8"].shape[0])])
    out["deep_gemm"] = [should_use_deepgemm_for_fp8_linear(torch.bfloat16, tuple(s), supports_deep_gemm=True)
                        for s in t["shapes"]]
    torch.save(out, root + "/vllm.pt")
''')

# vLLM's Triton kernels (their source in .venv-vllm) run by Triton's interpreter in this venv: `vllm.triton_utils`
# stands for the real Triton, which the CPU build replaces by a placeholder. Two of the interpreter's conversions are
# not the GPU's: float32 -> bfloat16 truncates (the GPU rounds to nearest even: torch's conversion stands in), and
# float32 -> e4m3 rounds some values to the binade below (126.97 -> 64, where the GPU's cvt.rn.satfinite and torch
# give 128: the kernels write their FP8 outputs into float32 buffers here and torch casts them).
KERNELS_SIDE = textwrap.dedent('''
    import ast, importlib.util, sys, types
    import torch, triton, triton.language as tl

    import numpy as np
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_rounding_to_nearest(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(data.view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_rounding_to_nearest
    site, root = sys.argv[1], sys.argv[2]
    shim = types.ModuleType("vllm.triton_utils"); shim.triton, shim.tl = triton, tl
    sys.modules["vllm"] = types.ModuleType("vllm"); sys.modules["vllm"].__path__ = []
    sys.modules["vllm.triton_utils"] = shim
    spec = importlib.util.spec_from_file_location("kpool", site + "/models/glm5next/nvidia/ops/kpool_compress.py")
    kpool = importlib.util.module_from_spec(spec); spec.loader.exec_module(kpool)
    # _per_token_group_quant_fp8 alone, out of fp8_utils.py (whose imports need the rest of vLLM)
    src = open(site + "/model_executor/layers/quantization/utils/fp8_utils.py").read()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_per_token_group_quant_fp8")
    scope = {"triton": triton, "tl": tl}
    exec(compile(ast.Module([fn], []), "fp8_utils.py", "exec"), scope)
    t = torch.load(root + "/inputs.pt")
    out = {}
    q = t["fwht"]  # fwht128_quant_fp8's launch
    out["fwht_q"], out["fwht_s"] = torch.empty(q.shape), torch.empty(q.shape[0], 1)
    kpool._fwht_quant_kernel[(triton.cdiv(q.shape[0], 32),)](q, out["fwht_q"], out["fwht_s"], q.shape[0], BLOCK_R=32)
    k = t["kpool"]  # kpool_compress_and_write_cache's launch with return_compressed, no cache write
    n, pool, dim = k["k"].shape
    cache = torch.zeros(1, 16, dim + 4, dtype=torch.uint8)
    out["pool_q"], out["pool_s"] = torch.empty(n, dim), torch.empty(n)
    kpool._kpool_softmax_rotate_write_cache_kernel[(n,)](
        cache.view(torch.float8_e4m3fn), cache.view(torch.float32), k["k"], k["gate"], k["ape"],
        torch.zeros(n, dtype=torch.int64), torch.empty(1, dtype=torch.bool), out["pool_q"], out["pool_s"],
        k["k"].stride(0), k["k"].stride(1), k["gate"].stride(0), k["gate"].stride(1), k["ape"].stride(0),
        PAGE_SIZE=16, BUF_NUMEL_PER_PAGE=cache.stride(0), POOL_SIZE=pool, HEAD_DIM=dim,
        S_OFFSET_NBYTES_IN_PAGE=16 * dim, ROUND_SCALE=True, HAS_WRITE_MASK=False, RETURN_COMPRESSED=True,
        WRITE_CACHE=False, BLOCK_D=dim)
    x = t["act_tiny"].contiguous()
    for ue8m0 in (False, True):
        q, s = torch.empty(x.shape), torch.empty(x.shape[0], x.shape[1] // 128)
        scope["_per_token_group_quant_fp8"][(x.numel() // 128,)](x, q, s, 128, x.shape[1], x.stride(0), 1e-10,
                                                                  fp8_min=-448.0, fp8_max=448.0, use_ue8m0=ue8m0, BLOCK=128)
        out[f"kernel_q{int(ue8m0)}"], out[f"kernel_s{int(ue8m0)}"] = q, s
    torch.save(out, root + "/kernels.pt")
''')


def _inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    # activations: groups of 128 over four decades; every group's max >= 1 / 512, where QuantFP8's native floor and
    # the kernels' agree (act_tiny has the groups below it, down to one of zeros and one below 1e-6, where the
    # kernel's floor of 1e-10, per_token_group_quant_fp8's default eps, decides the scale)
    act = rnd(6, 384) * (10 ** (torch.rand(6, 3, generator=g) * 4 - 1)).repeat_interleave(128, 1)
    tiny = rnd(6, 256) * torch.tensor([0.0, 1e-9, 1e-6, 1e-3, 1.0, 30.0])[:, None]
    w8, w_scale = quantize(rnd(256, 384) * 0.05, (128, 128))
    n, hid = 4, 64
    mhc = dict(residual=rnd(5, n, hid).bfloat16(), fn=rnd((2 + n) * n, n * hid) / 16, scale=torch.rand(3, generator=g) + 0.5,
               base=rnd((2 + n) * n) * 0.5, rms_eps=1e-6, eps=1e-6, iters=5, x=rnd(5, hid).bfloat16(),
               post=torch.rand(5, n, 1, generator=g) * 2, comb=torch.rand(5, n, n, generator=g))
    q8 = (rnd(3, 4, 128) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    k8 = (rnd(20, 128) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    logits = dict(q8=q8, k8=k8, k_scale=torch.exp2(torch.randint(-12, -4, (20,), generator=g).float()),
                  weights=rnd(3, 4).abs() * 1e-3)
    kpool = dict(k=(rnd(6, 4, 128) * 2).bfloat16(), gate=rnd(6, 4, 128).bfloat16(), ape=rnd(4, 128))
    fwht = rnd(9, 128) * 10 ** (torch.arange(9)[:, None] / 2.0 - 2.5)
    fwht[0] *= 1e-6  # a row below the 1e-4 floor of the kernel's absmax
    shapes = [(n_, k_) for n_ in (64, 96, 128, 192, 1024) for k_ in (64, 128, 192, 512)]
    return dict(act=act.bfloat16(), act_tiny=tiny.bfloat16(), w8=w8, w_scale=w_scale, h=rnd(7, 128), mhc=mhc,
                logits=logits, kpool=kpool, fwht=fwht.bfloat16(), shapes=shapes)


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """One vLLM process (its torch functions) and one interpreter process (its Triton kernels) on _inputs()."""
    root = tmp_path_factory.mktemp("numerics")
    torch.save(_inputs(), root / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    vllm = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_SIDE, str(root)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert vllm.returncode == 0, vllm.stderr[-3000:]
    kernels = subprocess.run([sys.executable, "-c", KERNELS_SIDE, str(SITE[0]), str(root)], capture_output=True,
                             text=True, timeout=600, env={**env, "TRITON_INTERPRET": "1"})
    assert kernels.returncode == 0, kernels.stderr[-3000:]
    return torch.load(root / "inputs.pt"), torch.load(root / "vllm.pt"), torch.load(root / "kernels.pt")


def _same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal e4m3 bytes; `want` a kernel's float32 output is cast as the GPU casts (round to nearest, saturating)."""
    want = want.to(torch.float8_e4m3fn) if want.dtype == torch.float32 else want
    assert got.dtype == want.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@needs_vllm
@pytest.mark.parametrize("ue8m0", [False, True])
def test_activation_group_quantization_is_vllms(sides, ue8m0):
    """Per token and 128-wide group: QuantFP8's native path (vLLM's torch fallback) where every group's max clears
    its floor, and the _per_token_group_quant_fp8 kernel everywhere, tiny groups included (the kernels floor the max
    at 1e-10, the native path floors the scale at 1 / (448 * 512))."""
    inputs, vllm, kernels = sides
    q, s = group_quant_fp8(inputs["act"], 128, ue8m0)
    _same_fp8(q, vllm[f"act_q{int(ue8m0)}"])
    # the native path divides by 448 where the kernels multiply by its reciprocal: float32 scales a rounding apart
    torch.testing.assert_close(s, vllm[f"act_s{int(ue8m0)}"], rtol=2**-23, atol=0)
    q, s = group_quant_fp8(inputs["act_tiny"], 128, ue8m0)
    _same_fp8(q, kernels[f"kernel_q{int(ue8m0)}"])
    assert torch.equal(s, kernels[f"kernel_s{int(ue8m0)}"])


@needs_vllm
def test_ue8m0_weight_requantization_is_deepgemms(sides):
    inputs, vllm, _ = sides
    q, s = requant_ue8m0(inputs["w8"], inputs["w_scale"], (128, 128))
    _same_fp8(q, vllm["requant_w"])
    assert torch.equal(s, vllm["requant_s"])
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two


@needs_vllm
def test_hadamard_is_vllms_butterfly(sides):
    inputs, vllm, _ = sides
    assert torch.equal(hadamard(inputs["h"]), vllm["hadamard"])


@needs_vllm
def test_query_rotation_and_fp8_is_fwht128_quant_fp8(sides):
    """Rows of magnitudes 1e-8 .. 1e2: the rotation, the bfloat16 rounding, the 1e-4 floor and the power-of-two scale."""
    inputs, _, kernels = sides
    q, s = rotate_quant_fp8(inputs["fwht"])
    _same_fp8(q, kernels["fwht_q"])
    assert torch.equal(s, kernels["fwht_s"].view(-1))


@needs_vllm
def test_pooled_keys_are_the_kpool_compress_kernels(sides):
    """Softmax over each pool's tokens per channel in float32, bfloat16, rotation, bfloat16, FP8: all 6 x 128 values
    and scales as the kernel writes them."""
    inputs, _, kernels = sides
    k = inputs["kpool"]
    q, s = pool_fp8(k["k"], k["gate"], k["ape"])
    _same_fp8(q, kernels["pool_q"])
    assert torch.equal(s, kernels["pool_s"])


@needs_vllm
def test_fp8_index_scores_are_vllms_mqa_logits(sides):
    """sum_h w_h relu(q8_h . k8_p) * k_scale_p, where the head weights carry q's scale and Di^-0.5 Hi^-0.5: scored
    as the runtime scores (exact keys q8 . (k8 * scale), pairwise sums) against vLLM's torch logits (a GEMM)."""
    inputs, vllm, _ = sides
    g = inputs["logits"]
    keys = g["k8"].float() * g["k_scale"][:, None]
    got = pool_scores(g["q8"].float(), g["weights"], keys, scale=1.0)
    torch.testing.assert_close(got, vllm["logits"], rtol=1e-6, atol=0)


@needs_vllm
def test_mhc_in_float32_is_vllms_mhc_pre_and_post(sides):
    inputs, vllm, _ = sides
    m = inputs["mhc"]
    w = HcWeights(m["fn"], m["base"], m["scale"], m["iters"], m["eps"], m["rms_eps"], float32_mix=True)
    post, comb, collapsed = hc_pre(w, m["residual"])
    want_post, want_comb, want_input = vllm["pre"]
    assert torch.equal(post, want_post[..., 0]) and torch.equal(comb, want_comb)
    assert torch.equal(collapsed, want_input)
    got = hc_post(m["x"], m["residual"], m["post"][..., 0], m["comb"], float32_mix=True)
    assert torch.equal(got, vllm["post"])
    # transformers' form rounds post and comb to bfloat16 first: it differs (the difference the piece models)
    assert not torch.equal(hc_post(m["x"], m["residual"], m["post"][..., 0], m["comb"]), vllm["post"])


@needs_vllm
def test_deep_gemm_takes_what_vllm_gives_it(sides):
    inputs, vllm, _ = sides
    assert [deep_gemm_takes(*s) for s in inputs["shapes"]] == vllm["deep_gemm"]
    assert any(vllm["deep_gemm"]) and not all(vllm["deep_gemm"])


@pytest.mark.parametrize("ue8m0,shape", [(False, (5, 384)), (True, (5, 384)), (False, (3, 200))])
def test_block_fp8_gemm_against_float64(ue8m0, shape):
    """The W8A8 block GEMM as vLLM's kernels define it, recomputed in float64: x quantized per token and 128-group,
    each K-block's partial product times the activation's and the weight's block scales, summed (a last partial
    K-block included). A float64 run accumulates in float64: equal to 1e-12."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3
    w8, ws = quantize(torch.randn(160, shape[1], generator=g) * 0.1, (128, 128))
    got = fp8_linear(x, Fp8Weight(w8, ws, (128, 128), act_ue8m0=ue8m0))
    xq, xs = group_quant_fp8(x, 128, ue8m0)
    want = torch.zeros(shape[0], 160, dtype=torch.float64)
    for kb in range(math.ceil(shape[1] / 128)):
        cols = slice(kb * 128, (kb + 1) * 128)
        part = xq[:, cols].double() @ w8[:, cols].double().T  # [T, N]
        want += part * xs[:, kb, None].double() * ws[:, kb].double().repeat_interleave(128)[:160][None]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    plain = x @ (w8.double() * ws.double().repeat_interleave(128, 0)[:160].repeat_interleave(128, 1)[:, :shape[1]]).T
    assert (got - plain).abs().max() > 1e-3  # the activations' quantization shows


def test_kda_safe_gate_against_float64():
    """vLLM's KDA kernels run the bounded gate lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) always, with -5.0
    where the config gives none; transformers' form for None is -exp(A_log) * softplus(g + dt_bias)."""
    from qual.runtime.models.glm5.kda import KdaWeights, _forget_gate
    from qual.runtime.models.glm5.numerics import numerics_of, safe_gate_bound

    g = torch.Generator().manual_seed(2)
    H, D, hid = 2, 4, 8
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w = KdaWeights(qkv=mk(3 * H * D, hid), conv=mk(3 * H * D, 4), f_a=mk(D, hid), f_b=mk(H * D, D), dt_bias=mk(H * D),
                   a_log=mk(H), b=mk(H, hid), g_a=mk(D, hid), g_b=mk(H * D, D), o_norm=mk(D), o_proj=mk(hid, H * D),
                   num_heads=H, head_dim=D, lower_bound=safe_gate_bound(None, numerics_of("vllm")), eps=1e-6)
    x = mk(1, 3, hid)
    raw = (x @ w.f_a.T @ w.f_b.T + w.dt_bias).view(1, 3, H, D)
    want = -5.0 * torch.sigmoid(torch.exp(w.a_log)[:, None] * raw)
    torch.testing.assert_close(_forget_gate(w, x), want, rtol=0, atol=1e-15)
    assert safe_gate_bound(None, numerics_of("exact")) is None and safe_gate_bound(-3.0, numerics_of("vllm")) == -3.0


# -- the runtime under each numerics ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """A tiny GLM-5 FP8 checkpoint in vLLM's coverage (blocks of 4 x 8: the MLPs split into whole blocks at TP 2),
    with linear_lower_bound null."""
    from safetensors.torch import load_file, save_file

    from glm5_checkpoints import make_glm5, tiny_text
    from qual.checkpoints.fp8 import SCALE_SUFFIX
    from qual.runtime.models.glm5.fp8_weights import FP8_KEPT, fp8_load_path

    root = tmp_path_factory.mktemp("glm5vllm")
    path = make_glm5(root / "m", tiny_text(layer_types=["linear_attention", "indexed_attention"] * 2,
                                           mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                                           linear_lower_bound=None))
    weights = load_file(str(path / "model.safetensors"))
    for name in [n for n in weights if fp8_load_path(n) == FP8_KEPT and ".visual." not in n]:
        weights[name], weights[name + SCALE_SUFFIX] = quantize(weights[name].float(), (4, 8))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [4, 8]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_what_each_numerics_loads(fp8_model):
    """exact: FP8 MLPs and wq_b dequantized, the experts FP8 with float inputs, transformers' MHC and softplus gate;
    vllm: vLLM's FP8 weights and GEMMs, FP8 indexer, float32 MHC, safe gate at -5; vllm-hopper: DeepGEMM's scales
    where it would run (none of these tiny shapes: N % 64 or K % 128) and power-of-two activations for the experts."""
    from qual.runtime.models.glm5.moe import Fp8Experts
    from qual.runtime.models.glm5.weights import load_glm5_weights

    for name in ("exact", "vllm", "vllm-hopper"):
        w = load_glm5_weights(fp8_model, 0, 1, torch.float64, "cpu", name)
        dense, mla = w.layers[0], w.layers[1]
        vllm = name != "exact"
        assert isinstance(dense.mlp.gate, Fp8Weight) == vllm and isinstance(mla.indexer.wq_b, Fp8Weight) == vllm
        assert isinstance(mla.moe.gate, Fp8Experts) and mla.moe.gate.fp8_gemm == vllm
        assert mla.moe.gate.act_ue8m0 == (name == "vllm-hopper") and not (vllm and dense.mlp.gate.act_ue8m0)
        assert mla.indexer.fp8 == vllm and dense.attn_hc.float32_mix == vllm
        assert dense.kda.lower_bound == (-5.0 if vllm else None)


def test_a_null_lower_bound_is_said_under_either_numerics(fp8_model):
    from qual.runtime.models.glm5.config import load_glm5_config
    from qual.runtime.models.glm5.target import Glm5Target

    cfg = load_glm5_config(fp8_model)
    exact, vllm = Glm5Target.notes(cfg, "exact"), Glm5Target.notes(cfg, "vllm")
    assert len(exact) == len(vllm) == 1
    assert "runs transformers' softplus KDA gate; vLLM runs its safe gate with lower bound -5.0" in exact[0]
    assert "runs vLLM's KDA safe gate with its default lower bound -5.0" in vllm[0]
    bounded = load_glm5_config(REPO / "qual/data/models/glm-toy/target")
    assert Glm5Target.notes(bounded, "exact") == Glm5Target.notes(bounded, "vllm") == []


@pytest.mark.slow
def test_dcp_2_decodes_as_dcp_1_under_vllms_numerics(fp8_model, tmp_path):
    """float64: TP 2 / DCP 2 gives TP 1's tokens under numerics vllm (FP8 groups align with the TP slices, index
    scores are elementwise), and they are not the exact numerics' tokens (the pieces are wired)."""
    import qual.cli.generate  # noqa: F401  (registers `qual generate` on the app)
    from qual.cli.main import run_app

    g = torch.Generator().manual_seed(3)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": torch.randint(
        1, 96, (n,), generator=g).tolist()}) + "\n" for i, n in enumerate((5, 41, 23, 30))))

    def generate(numerics, tp):
        out = tmp_path / f"{numerics}-{tp}.jsonl"
        assert run_app(["generate", "--target", str(fp8_model), "--prompts", str(prompts), "--tp", str(tp), "--dcp",
                        str(tp), "--max-tokens", "10", "--dtype", "float64", "--numerics", numerics,
                        "--out", str(out)]) == 0
        return [json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()]

    vllm = generate("vllm", 1)
    assert generate("vllm", 2) == vllm
    assert generate("exact", 1) != vllm


def test_fp8_index_query_and_head_weights_as_vllms_indexer_forward():
    """Indexer.forward recomputed from vLLM's source: q = wq_b(qr) per head through fwht128_quant_fp8; the head
    weights a float32 GEMM of the hidden state, times each head's q scale, times Di^-0.5 * Hi^-0.5 (one constant),
    in that order; bfloat16 hidden states, as vLLM runs."""
    from qual.runtime.models.glm5.dsa import IndexerWeights, index_query

    g = torch.Generator().manual_seed(4)
    Hi, Di, hid, qlr = 4, 128, 64, 32
    mk = lambda *s: (torch.randn(*s, generator=g) / math.sqrt(s[-1])).bfloat16()  # noqa: E731
    w = IndexerWeights(wq_b=mk(Hi * Di, qlr), wk=mk(Di, hid), k_norm_weight=mk(Di), k_norm_bias=mk(Di),
                       weights_proj=mk(Hi, hid), compress_gate=mk(Di, hid), compress_ape=torch.zeros(4, Di),
                       select_pools=2, select_tail=True, fp8=True)
    x, qr = mk(5, hid) * 8, mk(5, qlr) * 8
    q, weights = index_query(w, x, qr)
    q8, q_scale = rotate_quant_fp8((qr @ w.wq_b.T).view(5, Hi, Di))
    want = torch.mm(x.float(), w.weights_proj.t().contiguous().float()) * q_scale * (Di**-0.5 * Hi**-0.5)
    assert torch.equal(q, q8.float()) and weights.dtype == torch.float32
    torch.testing.assert_close(weights, want, rtol=1e-6, atol=0)  # a GEMM's summation order is the BLAS's
    plain = (x @ w.weights_proj.T).float() * q_scale * (Di**-0.5 * Hi**-0.5)  # the same GEMM in bfloat16
    assert not torch.allclose(plain, want, rtol=1e-4, atol=0)
