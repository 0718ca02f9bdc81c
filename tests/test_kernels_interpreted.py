"""The Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1), against the PyTorch path.

Each check runs in a fresh interpreter process: Triton reads TRITON_INTERPRET when a kernel is defined.
Skipped where Triton is not installed (it is in the dev extra; CUDA builds of torch bring it too).
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton)")

ROOT = Path(__file__).resolve().parents[1]

FUSED_DECODE = """
import tempfile
from dataclasses import replace
from pathlib import Path
from checkpoints import make_target
from runtime_helpers import prompts
from qual.runtime.config import CacheConfig, EngineConfig, SamplingParams
from qual.runtime.engine import LLMEngine
from qual.errors import QualError
from qual.runtime.backends.fused_decode import FusedDecode

with tempfile.TemporaryDirectory() as tmp:
    target = make_target(Path(tmp) / "t", num_hidden_layers=2, num_key_value_heads={kv}, head_dim={head_dim})
    cfg = EngineConfig(str(target), dtype="float32", cache=CacheConfig(block_size=4, memory_bytes=2**22))
    reqs, sp = prompts(3, max_tokens=3)[::2], SamplingParams(max_tokens=3)  # 3 and 40 tokens
    with LLMEngine(cfg) as engine:
        ref = [engine.generate([r], sp)[0].output_token_ids for r in reqs]
        fused = engine.runner.target.fused = FusedDecode(engine.runner.target, programs={programs}, sync=False)
        fused.tiling = replace(fused.tiling, key_block={key_block})  # small: several key blocks a unit
        got = [engine.generate([r], sp)[0].output_token_ids for r in reqs]
        fused.timeouts.fill_(1)  # as a barrier that gave up would leave it
        try:
            engine.generate(prompts(1, max_tokens=2), SamplingParams(max_tokens=2))  # one fused step
            raise AssertionError("a timed-out barrier went unreported")
        except QualError as exc:
            assert "grid barrier timed out" in str(exc), exc
    assert fused.flags is not None, "the fused path never ran"
    assert got == ref, (got, ref)
print("ok")
"""

PAGED_ATTENTION = """
import torch
from qual.runtime.attention import attention_with_lse
from qual.runtime.backends.paged_attention import paged_attention

g = torch.Generator().manual_seed(0)
for R, Q, H, Hk, D, S in [(3, 4, 4, 2, 16, 70), (2, 1, 8, 1, 32, 130), (1, 8, 2, 2, 16, 5)]:
    k_cache = torch.randn(300, Hk, D, generator=g)
    v_cache = torch.randn(300, Hk, D, generator=g)
    slots = torch.randperm(300, generator=g)[: R * S].view(R, S)
    q = torch.randn(R, Q, H, D, generator=g)
    mask = torch.rand(R, Q, S, generator=g) < 0.7
    mask[0, 0] = False  # a row that sees nothing: out 0, lse -inf
    lengths = torch.randint(1, S + 1, (R,), generator=g, dtype=torch.int32)
    lengths[-1] = S
    mask &= torch.arange(S)[None, None, :] < lengths[:, None, None].long()
    ref, ref_lse = attention_with_lse(q, k_cache[slots], v_cache[slots], mask, D**-0.5)
    for r in range(R):  # keys past a row's length must not be read at all: NaN there would reach the output
        k_cache[slots[r, lengths[r]:]] = float("nan")
        v_cache[slots[r, lengths[r]:]] = float("nan")
    for splits in (None, 1, 2, 3, 4):  # 3: a split of 0 keys in a 70-key row; 4: empty splits at 130 too
        out, lse = paged_attention(q, k_cache, v_cache, slots, mask, D**-0.5, lengths, splits)
        assert torch.allclose(out, ref, atol=1e-4), (splits, (out - ref).abs().max())
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), splits
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-4), splits
    if ((lengths < S) & mask.flatten(1).any(1)).any():  # without lengths every key is read: the NaN shows
        assert paged_attention(q, k_cache, v_cache, slots, mask, D**-0.5)[0].isnan().any()
print("ok")
"""

SKINNY_GEMM = """
import torch
from qual.runtime.backends.skinny_gemm import choose_config, partials

g = torch.Generator().manual_seed(0)
for m, n, k in [(1, 256, 512), (5, 100, 300), (16, 64, 1024)]:
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    parts = partials(x, w)
    assert parts.shape[0] == choose_config(n, k).split
    assert torch.allclose(parts.sum(0), x @ w.T, atol=1e-3), (parts.sum(0) - x @ w.T).abs().max()
print("ok")
"""

FINISHED_PRODUCT = """
import sys
import torch
sys.path.insert(0, "{bench}")
from skinny_gemm_sweep import reduced
from qual.runtime.backends.skinny_gemm import GemmConfig

g = torch.Generator().manual_seed(0)
counts = torch.zeros(64, dtype=torch.int32)
# float32 inputs: the interpreter's bfloat16 products are wrong; the output is bf16 as on the GPU
for m, n, k, cfg in [(1, 256, 512, GemmConfig(64, 64, 1)), (5, 100, 300, GemmConfig(32, 64, 3)),
                     (16, 64, 1024, GemmConfig(32, 128, 4))]:
    rows = torch.randn(m, k + 40, generator=g)
    x, w = rows[:, :k], torch.randn(n, k, generator=g)  # x: rows of a wider tensor, as the chain reads them
    for launch in range(2):  # the count left at zero for the next launch
        out = reduced(x, w, counts, cfg)
        ref = 0.01 * x @ w.T
        assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-3), (m, n, k, launch)
        assert not counts.any(), counts
print("ok")
"""


FUSED_LAYER_PRODUCTS = """
import torch
import torch.nn.functional as F
import fused_layer_reference as ref
from qual.runtime.backends import fused_layer as fl
from qual.runtime.backends.fused_layer import ProductConfig
from qual.runtime.models.layers import Rope, rms_norm

TOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9}  # of the output's largest magnitude
EPS = 1e-6
g = torch.Generator().manual_seed(0)


def close(name, got, exact, torch_path, dt):
    # within TOL of float64; in float16 also no further from it than twice the PyTorch path (the interpreter
    # casts float32 to bfloat16 by truncation, the GPU to nearest: in bf16 that comparison is for the GPU test)
    scale = exact.abs().max().item()
    err, err_torch = (got.double() - exact).abs().max().item(), (torch_path.double() - exact).abs().max().item()
    assert err <= TOL[dt] * scale, (name, dt, err, scale)
    assert dt == torch.bfloat16 or err <= 2 * err_torch + 2**-12 * scale, (name, dt, err, err_torch, scale)


def rnd(*shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


counts = torch.zeros(64, dtype=torch.int32)
for dt in (torch.bfloat16, torch.float16):
    # rows, N, K, config: ragged column and K blocks, split 1, 2, 3 (non-power-of-2) and 4
    for m, n, k, cfg in [(1, 100, 200, ProductConfig(64, 64, 1)), (3, 200, 300, ProductConfig(64, 64, 2)),
                         (8, 96, 256, ProductConfig(32, 64, 4)), (16, 64, 448, ProductConfig(32, 64, 3))]:
        x, res = rnd(m, k).to(dt), rnd(m, n).to(dt)
        w, gu, ln = rnd(n, k, scale=k**-0.5).to(dt), rnd(2 * n, k, scale=k**-0.5).to(dt), (1 + rnd(k, scale=0.2)).to(dt)
        for launch in range(2):  # the counts left at zero for the next launch
            out = fl.residual_product(x, w, res, counts, cfg)
            close("residual", out, ref.residual(x, w, res), res + F.linear(x, w), dt)
            assert not counts.any(), counts
            act = fl.swiglu_product(x, ln, EPS, gu, counts, cfg)
            gate, up = F.linear(rms_norm(x, ln, EPS), gu).chunk(2, dim=-1)
            close("swiglu", act, ref.swiglu(x, ln, EPS, gu), F.silu(gate) * up, dt)
            assert not counts.any(), counts
    # rows, heads, KV heads (GQA group 1, 4, 8, 4), K, split; each row's position, consecutive from first
    D, block = 32, 4
    for m, H, Hk, k, split, first in [(1, 2, 2, 200, 1, 0), (3, 8, 2, 300, 2, 2), (8, 8, 1, 256, 4, 30),
                                      (16, 4, 1, 192, 3, 7)]:
        x, ln = rnd(m, k).to(dt), (1 + rnd(k, scale=0.2)).to(dt)
        w, qkn = rnd((H + 2 * Hk) * D, k, scale=k**-0.5).to(dt), (1 + rnd(H + Hk, D, scale=0.2)).to(dt)
        positions = torch.arange(first, first + m)  # rows of one request: several cross a block of `block` keys
        table = torch.randperm(16, generator=g)  # its blocks, scattered over the cache
        slots = table[positions // block] * block + positions % block
        kc, vc = torch.zeros(16 * block, Hk, D, dtype=dt), torch.zeros(16 * block, Hk, D, dtype=dt)
        rope = Rope(D, 10000.0, None, dt)
        q = fl.qkv_product(x, ln, EPS, w, qkn, positions, rope.inv_freq, slots, kc, vc, H, Hk, counts,
                           ProductConfig(D, 64, split))
        assert not counts.any(), counts
        exact_q, exact_k, exact_v = ref.qkv(x, ln, EPS, w, qkn, positions, rope.inv_freq, H, Hk)
        y = F.linear(rms_norm(x, ln, EPS), w).view(m, H + 2 * Hk, D)  # the PyTorch path (layers.project_qkv)
        qk = rope(rms_norm(y[:, : H + Hk], qkn, EPS), positions)
        close("q", q.view(m, H, D), exact_q, qk[:, :H], dt)
        close("k", kc[slots], exact_k, qk[:, H:], dt)
        close("v", vc[slots], exact_v, y[:, H + Hk:], dt)
        untouched = torch.ones(16 * block, dtype=torch.bool)
        untouched[slots] = False
        assert not kc[untouched].any() and not vc[untouched].any(), "a write outside the rows' slots"
print("ok")
"""

FUSED_LAYER_STEPS = """
import tempfile
from pathlib import Path
import torch
from checkpoints import make_draft, make_target
from runtime_helpers import prompts
from qual.runtime.backends.layer_products import LayerProducts
from qual.runtime.config import CacheConfig, EngineConfig, SamplingParams
from qual.runtime.engine import LLMEngine

HEADS, KV = {heads}, {kv}
shape = dict(num_hidden_layers=2, hidden_size=96, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=32,
             intermediate_size=160)


def generate(dtype, fused, target, draft):
    # compiled: every run at static shapes (padded rows), the fused one's step compiled around the products' custom ops
    cfg = EngineConfig(str(target), str(draft) if draft else None, dtype=dtype,
                       backend="{backend}" if fused else "pytorch", static_shapes="{backend}" == "compiled",
                       cache=CacheConfig(block_size=4, memory_bytes=2**22))
    steps = []
    with LLMEngine(cfg) as engine:
        t = engine.runner.target
        if fused:
            t.layer_products = LayerProducts(t.cfg.hidden_size, t.cfg.intermediate_size, t.layout.num_heads,
                                             t.layout.num_kv_heads, t.layout.head_dim, t.cfg.rms_norm_eps, t.comm.device)
        forward = t.forward

        def spy(tokens, positions, meta, stores):
            out = forward(tokens, positions, meta, stores)
            if not meta.prefill:  # a decode or verify step: the layers' output (the final norm's input is inside)
                steps.append((tokens.clone(), out[0].double().clone()))
            store = stores["target"]
            steps_kv[:] = [store.k_all.double().clone(), store.v_all.double().clone()]
            return out

        steps_kv = []
        t.forward = spy
        reqs = prompts(3, max_tokens=4)
        tokens = [o.output_token_ids for o in engine.generate(reqs, SamplingParams(max_tokens=4))]
    return tokens, steps, steps_kv


with tempfile.TemporaryDirectory() as tmp:
    target = make_target(Path(tmp) / "t", **shape)
    draft = make_draft(Path(tmp) / "d", num_target_layers=2, target_layer_ids=(0, 1), **shape) if {spec} else None
    exact = generate("float64", False, target, draft)
    referenced = []
    for dtype, tol in (("float16", 2**-8), ("bfloat16", 2**-5))[:{dtypes}]:
        plain, fused = generate(dtype, False, target, draft), generate(dtype, True, target, draft)
        assert fused[0] == plain[0], (dtype, fused[0], plain[0])  # greedy tokens
        assert any(not torch.equal(f, p) for (_, f), (_, p) in zip(fused[1], plain[1])), "the fused path never ran"
        rows = [t.numel() for t, _ in fused[1]]
        assert rows == [t.numel() for t, _ in plain[1]] and max(rows) > 1, rows  # several rows: batches or verify
        # where the half-precision tokens are float64's (bf16 may meet a near tie), each step's hidden states and
        # the KV caches are held against float64: within tol of their scale, and in float16 (which the interpreter
        # rounds to nearest) no further from it than twice the PyTorch path; else against the PyTorch path only
        ref = exact if plain[0] == exact[0] else plain
        referenced.append(ref is exact)
        n = min(t.shape[1] for t in exact[2] + fused[2]) - 1  # the slots both hold (beyond: a trash slot)
        # the steps fed the same tokens (a speculative step's drafts follow the hidden states before: they may differ)
        pairs = [(f, p, e) for (tf, f), (tp, p), (te, e) in zip(fused[1], plain[1], ref[1])
                 if torch.equal(tf, te) and torch.equal(tp, te)]
        assert len(pairs) >= len(rows) / 2, (len(pairs), len(rows))
        if len(pairs) == len(rows):  # the caches too (else rejected drafts' keys differ where drafts did)
            pairs += [(f[:, :n], p[:, :n], e[:, :n]) for f, p, e in zip(fused[2], plain[2], ref[2])]
        else:
            assert dtype == "bfloat16", "float16 steps fed other tokens than float64's"
        for f, p, e in pairs:
            scale = e.abs().max().item()
            err, err_plain = (f - e).abs().max().item(), (p - e).abs().max().item()
            assert err <= tol * scale, (dtype, err, scale)
            assert ref is plain or dtype == "bfloat16" or err <= 2 * err_plain + 2**-12 * scale, (err, err_plain)
    assert referenced[0], "float16 tokens left float64's"
print("ok")
"""


def interpret(code: str) -> None:
    path = [str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("kv,head_dim,programs,key_block", [(2, 32, 5, 16), (1, 16, 3, 4)],
                         ids=["gqa2-dot", "gqa4-broadcast"])
def test_fused_decode_gives_the_per_layer_tokens(kv, head_dim, programs, key_block):
    """One kernel for all layers (run phase by phase: the interpreter has no concurrent programs) generates
    the same greedy tokens as the per-layer path, float32. head_dim 32 takes the tl.dot attention, 16 the
    broadcast one; the keys are split over 2 and 3 chunks per KV head (3: a non-power-of-2 merge), each
    chunk walked in blocks of 16 and 4 keys (prompts of 3 and 40 tokens + 3 generated: one block, then several). Two
    layers (a barrier between them) and two fused steps a prompt (the second reads the keys the first wrote)
    are the smallest run that checks all of that; the interpreter runs every program's every op in Python."""
    interpret(FUSED_DECODE.format(kv=kv, head_dim=head_dim, programs=programs, key_block=key_block))


def test_paged_attention_matches_gather_then_attend():
    """The paged-attention kernel (reads the store in place) equals gathering the keys and attention_with_lse:
    GQA, several query positions, non-contiguous slots, an empty row (lse -inf, output 0), rows shorter
    than the key width, whose padding keys it does not read, and each row's keys split over 1-4 programs
    and merged (some splits with no keys)."""
    interpret(PAGED_ATTENTION)


def test_split_k_partials_sum_to_the_product():
    """The split-K GEMM's float32 partials sum to x @ w.T (ragged N and K, 1 to 16 rows)."""
    interpret(SKINNY_GEMM)


def test_the_chains_finished_product_sums_its_own_partials():
    """bench/skinny_gemm_sweep.py's `finished` product: the last split program of each column block sums the float32
    partials and writes 0.01 x @ w.T in bf16 (1 and 3 and 4 splits, ragged N and K, rows of a wider tensor), and
    leaves the block's count at zero for the next launch."""
    interpret(FINISHED_PRODUCT.format(bench=ROOT / "bench"))


def test_fused_decode_tiling_fits_registers_or_says_why():
    """The 0.6B shape fits one tile a program (the MLP step shrinks for wider models); a 4B-wide one is refused."""
    from qual.runtime.backends.decode_layers import Tiling

    small = Tiling.for_shape(132, 1024, 3072, 4096, 8, 128)
    assert small.too_big(1024) is None and (small.rows_qkv, small.rows_mlp, small.rows_mlp_step) == (32, 24, 32)
    assert Tiling.for_shape(132, 2048, 6144, 4096, 8, 128).rows_mlp_step == 16
    wide = Tiling.for_shape(132, 2560, 9728, 6144, 8, 128)
    assert "q/k/v rows x hidden 2560 per program exceed 128 KiB" in wide.too_big(2560)


def test_tiling_spec_changes_only_what_it_names():
    """Benchmarks name tilings as num_warps x MLP rows a step x poll x attention x prefetches [x key block]
    (bench/*.py)."""
    from dataclasses import replace

    from qual.runtime.backends.decode_layers import Tiling

    base = Tiling.for_shape(132, 1024, 3072, 4096, 8, 128)
    t = base.with_spec("4x16xvxbxq")
    assert (t.num_warps, t.rows_mlp_step, t.poll_acquire, t.attn_dot, t.key_block) == (4, 16, False, False, 64)
    assert (t.prefetch_qkv, t.prefetch_mlp) == (True, False)
    assert (t.rows_qkv, t.o_chunks, t.rows_o, t.rows_mlp) == (base.rows_qkv, base.o_chunks, base.rows_o, base.rows_mlp)
    assert base.with_spec("8x32xaxdxqm") == base
    assert base.with_spec("8x32xaxdxqmxb16") == replace(base, key_block=16)
    with pytest.raises(ValueError, match="only b<keys a block>"):
        base.with_spec("8x32xaxdxqmxk0")


def test_key_splits_fill_the_gpu_only_where_rows_are_long():
    """Flash-decoding splits: a power of two, enough programs for 2 an SM, never under 128 keys of the width."""
    from qual.runtime.backends.paged_attention import key_splits

    h200 = 2 * 132
    assert key_splits(h200, 1, 8, 192) == 1  # short static width: one program walks it
    assert key_splits(h200, 1, 8, 2048) == 16  # 2048 // 128 = 16 splits of 128 keys
    assert key_splits(h200, 1, 8, 4000) == 16  # 33 wanted, 31 allowed: 16
    assert key_splits(h200, 8, 8, 4000) == 4  # 264 // 64
    assert key_splits(h200, 64, 8, 4000) == 1  # 512 programs already


def test_fused_layer_products_match_float64():
    """fused-layer's products (qual/runtime/backends/fused_layer.py) against float64 recomputations from their
    definitions (tests/fused_layer_reference.py) and against the PyTorch path they replace: the residual and SwiGLU
    products at 1 / 3 / 8 / 16 rows, ragged column and K blocks, split 1, 2, 3 and 4, each launched twice on one
    count buffer (left at zero); the qkv product's q (q norm, RoPE), the keys (k norm, RoPE) and values written at
    each row's slot of a paged cache (positions crossing a block of keys, blocks scattered), nothing else written,
    GQA groups 1, 4, 8; bf16 and fp16."""
    interpret(FUSED_LAYER_PRODUCTS)


@pytest.mark.parametrize("heads,kv,spec,backend,dtypes", [
    (8, 2, False, "pytorch", 2), (8, 1, True, "pytorch", 2),
    pytest.param(8, 2, False, "compiled", 1, marks=pytest.mark.slow)], ids=["gqa4-batch3", "gqa8-verify", "compiled"])
def test_fused_layer_steps_match_float64(heads, kv, spec, backend, dtypes):
    """A Qwen3 target's decode steps through the fused-layer products (Qwen3Target._fused_layer: the engine's own
    path, attention in PyTorch between them) give the PyTorch path's greedy tokens, and each step's hidden states and
    the KV caches are as near float64 as tolerance allows (fp16: no further than twice the PyTorch path's error):
    three requests decoded together, or speculative verify blocks of 4 rows a request (a DFlash drafter); and in float16
    the compiled static-shape step (torch.compile around the products' custom ops, the KV caches they write
    declared mutated), about a minute on two cores."""
    interpret(FUSED_LAYER_STEPS.format(heads=heads, kv=kv, spec=spec, backend=backend, dtypes=dtypes))
