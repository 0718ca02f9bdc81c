"""Every Triton kernel of qual/runtime/backends compiled for a Hopper GPU on the CPU (tests/hopper_compile.py), from
the launches the backends make: the compiler refuses code Triton's interpreter runs, and CI has no GPU.

Each script runs in a fresh process without TRITON_INTERPRET; its launches are recorded, not run.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

def _nvidia_backend() -> bool:
    return importlib.util.find_spec("triton") is not None and importlib.util.find_spec("triton.backends.nvidia") is not None


pytestmark = pytest.mark.skipif(not _nvidia_backend(), reason="needs Triton with its NVIDIA backend (pip install triton)")

ROOT = Path(__file__).resolve().parents[1]

PRODUCTS = """
import torch
from qual.runtime.backends.skinny_gemm import partials

for m, n, k in [(3, 640, 256), (16, 100, 300)]:  # ragged column and K blocks
    for pdl in (False, True):
        partials(torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), pdl=pdl)
"""

FINISHED = """
import sys
import torch
sys.path.insert(0, "{bench}")
from skinny_gemm_sweep import reduced
from qual.runtime.backends.skinny_gemm import GemmConfig

counts = torch.zeros(64, dtype=torch.int32)
x, w = torch.randn(3, 4096).bfloat16(), torch.randn(640, 4096).bfloat16()
for cfg in (GemmConfig(64, 128, 1), GemmConfig(64, 128, 4)):
    for pdl in (False, True):
        reduced(x, w, counts, cfg, pdl)
"""

GLUON_PRODUCTS = """
import torch
from qual.runtime.backends.gluon_gemm import GluonConfig, finished, partials

# the 8B shape's qkv with PDL (first: its PTX is read), down and the LM head at choose_config, a row or sixteen
for pdl, m, n, k in [(True, 1, 6144, 4096), (False, 1, 6144, 4096), (True, 16, 4096, 14336), (True, 1, 128256, 4096)]:
    partials(torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), pdl=pdl)
# ragged column and K blocks, fp16; the finishing product unsplit and split, with a residual and without
partials(torch.randn(3, 328).half(), torch.randn(200, 328).half(), GluonConfig(64, 64, 3, 2))
counts = torch.zeros(64, dtype=torch.int32)
x, w = torch.randn(3, 4096).bfloat16(), torch.randn(640, 4096).bfloat16()
finished(x, w, counts, torch.randn(3, 640).bfloat16(), 0.5, GluonConfig(128, 64, 1), True)
finished(x, w, counts, torch.randn(3, 640).bfloat16(), 0.5, GluonConfig(128, 64, 4), True)
finished(x, w, counts, cfg=GluonConfig(64, 128, 4, 3))
"""

ATTENTION = """
import torch
from qual.runtime.backends.paged_attention import paged_attention

for dt in (torch.bfloat16, torch.float32):
    R, Q, H, Hk, D, S = 2, 4, 8, 2, 128, 300
    q, cache = torch.randn(R, Q, H, D).to(dt), torch.randn(2 * R * S, Hk, D).to(dt)
    slots, mask = torch.arange(R * S).view(R, S), torch.ones(R, Q, S, dtype=torch.bool)
    for splits in (1, 2):  # 2: the combine kernel too
        for pdl in (False, True):
            paged_attention(q, cache, cache, slots, mask, D**-0.5, None, splits, pdl)
"""

ATTENTION_STEPS = """
import torch
from qual.runtime.backends.paged_attention import paged_attention

Hk, D, S = 8, 128, 192  # the 8B shape's KV heads and head size, a short row's static key width
for G in (2, 4, 8):  # query heads a KV head
    for Q in (1, 16):  # a plain step's query position, a speculative verify's block
        q, cache = torch.randn(1, Q, G * Hk, D).bfloat16(), torch.randn(4 * S, Hk, D).bfloat16()
        slots, mask = torch.arange(S).view(1, S), torch.ones(1, Q, S, dtype=torch.bool)
        paged_attention(q, cache, cache, slots, mask, D**-0.5, None, 1)
"""

FUSED = """
import tempfile
from pathlib import Path
from checkpoints import make_target
from runtime_helpers import prompts
from qual.runtime.config import CacheConfig, EngineConfig, SamplingParams
from qual.runtime.engine import LLMEngine
from qual.runtime.backends.fused_decode import FusedDecode

with tempfile.TemporaryDirectory() as tmp:
    target = make_target(Path(tmp) / "t", num_hidden_layers=2, num_key_value_heads=2, head_dim=32)
    cfg = EngineConfig(str(target), dtype="bfloat16", cache=CacheConfig(block_size=4, memory_bytes=2**22))
    with LLMEngine(cfg) as engine:
        for sync in (True, False):
            engine.runner.target.fused = FusedDecode(engine.runner.target, programs=5, sync=sync)
            engine.generate(prompts(1, max_tokens=2), SamplingParams(max_tokens=2))
"""

FUSED_LAYER = """
import torch
from qual.runtime.backends import fused_layer as fl
from qual.runtime.backends.skinny_gemm import partials

H, I, NH, NKV, D = 4096, 14336, 32, 8, 128  # the 8B shape
for m in (1, 16):  # a plain step's row, a verify block's sixteen
    x, ln = torch.randn(m, H).bfloat16(), torch.randn(H).bfloat16()
    for n, k in [((NH + 2 * NKV) * D, H), (H, NH * D), (2 * I, H), (H, I)]:  # the split-K kernel, as triton-gemm
        partials(torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), pdl=True)
    for pdl in (False, True):
        counts, cache = torch.zeros(512, dtype=torch.int32), torch.zeros(64, NKV, D).bfloat16()
        fl.qkv_product(x, ln, 1e-6, torch.randn((NH + 2 * NKV) * D, H).bfloat16(), torch.randn(NH + NKV, D).bfloat16(),
                       torch.arange(m), torch.rand(D // 2), torch.arange(m), cache, cache, NH, NKV, counts, pdl=pdl)
        fl.residual_product(torch.randn(m, NH * D).bfloat16(), torch.randn(H, NH * D).bfloat16(), x, counts, pdl=pdl)
        fl.swiglu_product(x, ln, 1e-6, torch.randn(2 * I, H).bfloat16(), counts, pdl=pdl)
        fl.residual_product(torch.randn(m, I).bfloat16(), torch.randn(H, I).bfloat16(), x, counts, pdl=pdl)
"""

FUSED_LAYER_LATE_LAUNCH = """
import torch
from dataclasses import replace
from qual.runtime.backends import fused_layer as fl

H, I, NH, NKV, D = 4096, 14336, 32, 8, 128  # the 8B shape, a plain step's row, with PDL: at start, then late
m = 1
x, ln = torch.randn(m, H).bfloat16(), torch.randn(H).bfloat16()
counts, cache = torch.zeros(512, dtype=torch.int32), torch.zeros(64, NKV, D).bfloat16()
for late in (False, True):
    fl.qkv_product(x, ln, 1e-6, torch.randn((NH + 2 * NKV) * D, H).bfloat16(), torch.randn(NH + NKV, D).bfloat16(),
                   torch.arange(m), torch.rand(D // 2), torch.arange(m), cache, cache, NH, NKV, counts,
                   replace(fl.qkv_config((NH + 2 * NKV) * D, H, D), late_launch=late), pdl=True)
    fl.swiglu_product(x, ln, 1e-6, torch.randn(2 * I, H).bfloat16(), counts,
                      replace(fl.swiglu_config(2 * I, H), late_launch=late), pdl=True)
    fl.residual_product(torch.randn(m, I).bfloat16(), torch.randn(H, I).bfloat16(), x, counts,
                        replace(fl.residual_config(H, I), late_launch=late), pdl=True)
"""

GLUON_FUSED_LAYER = """
import types
import torch
from qual.runtime.backends.gluon_layer_products import GluonLayerProducts

# A Qwen3 decode layer's launches through the backend part: qkv (with PDL first: its PTX is read), o with the next
# norm's x * ln, gate/up (two half tiles a stage), down with and without a next norm (the last layer); the 8B shape
# at 1 and 16 rows, a 64-wide head at 3 rows without PDL.
for (H, I, NH, NKV, D), m, pdl in [((4096, 14336, 32, 8, 128), 1, True), ((4096, 14336, 32, 8, 128), 16, True),
                                   ((1024, 3072, 16, 8, 64), 3, False)]:
    p = GluonLayerProducts(H, I, NH, NKV, D, 1e-6, torch.device("cpu"), pdl=pdl)
    x, ln = torch.randn(m, H).bfloat16(), torch.randn(H).bfloat16()
    attn = types.SimpleNamespace(qkv=torch.randn((NH + 2 * NKV) * D, H).bfloat16(),
                                 qk_norm=torch.randn(NH + NKV, D).bfloat16(), o=torch.randn(H, NH * D).bfloat16())
    mlp = types.SimpleNamespace(gate_up=torch.randn(2 * I, H).bfloat16(), down=torch.randn(H, I).bfloat16())
    kc, vc = torch.zeros(64, NKV, D).bfloat16(), torch.zeros(64, NKV, D).bfloat16()
    q = p.qkv(x, p.enter(x, ln), ln, attn, torch.arange(m), torch.rand(D // 2), torch.arange(m), kc, vc)
    x, x_ln = p.o(q, attn.o, x, ln)
    p.mlp(x, x_ln, ln, mlp, ln)
    p.mlp(x, x_ln, ln, mlp, None)
"""


# The GPU image's Triton (Makefile: DEVICE_TRITON_VERSION), which `make test` puts beside the venv's own: the
# kernels are compiled with it where it is there, so that registers and spills are the ones the GPU runs
DEVICE_TRITON = Path(sys.prefix) / "triton-device"


def compile_for_hopper(script: str, *flags: str) -> str:
    device_triton = [str(DEVICE_TRITON)] if (DEVICE_TRITON / "triton").is_dir() else []
    path = [*device_triton, str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join(path), TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "hopper_compile.py"), *flags], input=script, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def compile_ptx(script: str) -> str:
    """The PTX of the one kernel the script launches, compiled for sm_90 (hopper_compile.py --ptx)."""
    return compile_for_hopper(script, "--ptx").split("ok\n")[0].split("PTX:\n", 1)[1]


def test_split_k_product_compiles_for_hopper():
    """The split-K product, even and ragged blocks, with and without PDL; with PDL no global load is issued before
    the wait (x is the kernel before's output: a load the compiler hoisted above the wait would read it early)."""
    out = compile_for_hopper(PRODUCTS)
    lines = [line for line in out.splitlines() if line.startswith("_partials_kernel:")]
    assert len(lines) == 4, out
    early = [int(line.split(", ")[-1].split()[0]) for line in lines if "before its PDL wait" in line]
    assert early == [0, 0], out


def test_the_chains_finished_product_compiles_for_hopper():
    """bench/skinny_gemm_sweep.py's `finished` product (its atomic count and the last program's sum), 1 and 4 splits,
    with and without PDL."""
    out = compile_for_hopper(FINISHED.format(bench=ROOT / "bench"))
    assert out.count("_reduced_kernel:") == 4, out


@pytest.mark.skipif(not (DEVICE_TRITON / "triton").is_dir(), reason="needs the GPU image's Triton (make test)")
def test_gluon_products_compile_for_hopper_two_programs_an_sm():
    """The Gluon products (qual/runtime/backends/gluon_gemm.py) lower for sm_90 with the GPU image's Triton (its
    interpreter does not run Gluon): each program keeps within 96 registers a thread (8 warps: two programs an SM
    share its 64K, a quarter left for a small kernel launched early) and half an SM's shared memory, nothing spilled; with PDL the producer warp issues weight tiles
    (TMA) before its wait and x's after it, and no program stores before the wait."""
    out = compile_for_hopper(GLUON_PRODUCTS, "--ptx")
    lines = [line for line in out.splitlines() if line.startswith(("_partials_kernel:", "_finished_kernel:"))]
    assert len(lines) == 8 and sum(line.startswith("_finished_kernel:") for line in lines) == 3, out
    for line in lines:
        regs, shared = int(line.split(" registers")[0].split()[-1]), int(line.split(" B shared")[0].split()[-1])
        assert regs <= 96 and shared <= 113 << 10 and " 0 B stack" in line, line
    ptx = out.split("PTX:\n", 1)[1].split("\n_partials_kernel:", 1)[0]  # the first launch's: qkv with PDL
    # the producer's code: its first TMA copy, a wait, more copies (the consumer's own wait guards the stores)
    first_copy, producer_wait = ptx.index("cp.async.bulk.tensor"), ptx.rindex("griddepcontrol.wait")
    assert first_copy < producer_wait < ptx.rindex("cp.async.bulk.tensor"), "weight tiles issued before the PDL wait"
    assert ptx.index("griddepcontrol.wait") < ptx.index("st.global"), "a store before the PDL wait"


def test_paged_attention_compiles_for_hopper():
    """Paged attention and its split combine, bf16 and float32 caches, with and without PDL."""
    out = compile_for_hopper(ATTENTION)
    assert out.count("_paged_attention_kernel:") == 8 and out.count("_combine_kernel:") == 4, out


@pytest.mark.skipif(not (DEVICE_TRITON / "triton").is_dir(), reason="needs the GPU image's Triton (make test)")
def test_paged_attention_spills_no_register_at_decode_and_verify_shapes():
    """At a plain step's one query position and a speculative verify's 16, 2 to 8 query heads a KV head, head size
    128 in bf16, the attention kernel keeps its tiles in registers (no stack), compiled by the GPU image's Triton
    (a newer one spills 24 B at 2 query heads and 16 positions): a kernel that holds more in flight (keys and
    values a block ahead: docs/PERFORMANCE.md) takes 156-199 registers a thread where this one takes 118-164."""
    out = compile_for_hopper(ATTENTION_STEPS)
    lines = [line for line in out.splitlines() if line.startswith("_paged_attention_kernel:")]
    assert len(lines) == 6 and all(line.endswith(" 0 B stack") for line in lines), out


def test_fused_decode_compiles_for_hopper():
    """The one-kernel decode, as one launch (a GPU's grid barrier) and phase by phase."""
    out = compile_for_hopper(FUSED)
    assert out.count("_decode_layers_kernel:") >= 2, out


@pytest.mark.skipif(not (DEVICE_TRITON / "triton").is_dir(), reason="needs the GPU image's Triton (make test)")
def test_fused_layer_products_compile_within_the_split_k_kernels_registers():
    """fused-layer's products at the 8B shape (qkv with its q/k norm, RoPE and KV write; o and down with the residual;
    gate/up with SwiGLU), one and sixteen rows, with and without PDL, compiled by the GPU image's Triton: each takes no
    more registers a thread than the split-K kernel it replaces does at the same products (same compile), at most
    64 KB of shared memory a program (three an SM), nothing spilled (no stack: RoPE's cos and sin are arithmetic,
    libdevice's keep a stack for large angles), and with PDL no global load before the wait."""
    out = compile_for_hopper(FUSED_LAYER)
    regs = lambda line: int(line.split(" registers")[0].split()[-1])  # noqa: E731
    split_k = [regs(line) for line in out.splitlines() if line.startswith("_partials_kernel:")]
    fused = [line for line in out.splitlines() if line.startswith("_fused_product_kernel:")]
    assert split_k and len(fused) >= 6, out  # three epilogues, with PDL and without, at least
    for line in fused:
        assert regs(line) <= max(split_k) and int(line.split(" B shared")[0].split()[-1]) <= 64 << 10, (line, split_k)
        assert " 0 B stack" in line, line
        assert "before its PDL wait" not in line or ", 0 global loads before its PDL wait" in line, line


def test_fused_layer_late_launch_lets_the_next_kernel_launch_after_the_weight_stream():
    """ProductConfig.late_launch (the chain's `fused-layer+pdl, late launch`): each of the three epilogues' products
    calls griddepcontrol.launch_dependents after every asynchronous copy of its K loop is issued, where the default
    calls it before the first; both after the PDL wait, in the same registers' budget, nothing spilled."""
    import re

    out = compile_for_hopper(FUSED_LAYER_LATE_LAUNCH, "--ptx")
    kernels = out.split("\n_fused_product_kernel:")[1:]
    assert len(kernels) == 6, out
    for i, ptx in enumerate(kernels):
        head = ptx.split("\n", 1)[0]
        assert " 0 B stack" in head and int(head.split(" registers")[0].split()[-1]) <= 64, head
        launch = ptx.index("griddepcontrol.launch_dependents")
        copies = [m.start() for m in re.finditer(r"cp\.async\.c[ag]\.shared\.global", ptx)]
        assert ptx.index("griddepcontrol.wait") < launch and copies, head
        late = i >= 3
        assert all((c < launch) == late for c in copies), (i, head)


@pytest.mark.skipif(not (DEVICE_TRITON / "triton").is_dir(), reason="needs the GPU image's Triton (make test)")
def test_gluon_layer_products_compile_for_hopper_two_programs_an_sm():
    """The backend part gluon-layer's launches (GluonLayerProducts: the fused-layer epilogues on gluon_gemm's TMA
    ring) at the 8B shape, 1 and 16 rows, and a 64-wide head: within gluon_gemm's 96 registers a thread and half an
    SM's shared memory, nothing spilled; with PDL the producer warp issues weight tiles (TMA) before its wait, and no
    program stores before the wait; gate/up's stage is two TMA copies of half tiles."""
    out = compile_for_hopper(GLUON_FUSED_LAYER, "--ptx")
    lines = [line for line in out.splitlines() if line.startswith("_fused_kernel:")]
    assert len(lines) == 15, out
    for line in lines:
        regs, shared = int(line.split(" registers")[0].split()[-1]), int(line.split(" B shared")[0].split()[-1])
        assert regs <= 96 and shared <= 113 << 10 and " 0 B stack" in line, line
    ptx = out.split("PTX:\n", 1)[1].split("\n_fused_kernel:", 1)[0]  # the first launch's: qkv with PDL
    first_copy, producer_wait = ptx.index("cp.async.bulk.tensor"), ptx.rindex("griddepcontrol.wait")
    assert first_copy < producer_wait < ptx.rindex("cp.async.bulk.tensor"), "weight tiles issued before the PDL wait"
    assert ptx.index("griddepcontrol.wait") < ptx.index("st.global"), "a store before the PDL wait"
    # TMA copies a stage (each stage's copies complete one mbarrier's expected bytes): the weight tile and x's, and
    # gate/up's two half tiles (a layer's launches: qkv, o, gate/up, down twice)
    kernels = out.split("\n_fused_kernel:")[1:]
    per_stage = [k.count("cp.async.bulk.tensor") / k.count("mbarrier.arrive.expect_tx") for k in kernels]
    assert per_stage == [3.0 if i % 5 == 2 else 2.0 for i in range(15)], per_stage
