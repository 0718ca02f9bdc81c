"""CUDA and NCCL: the same invariants on GPUs, plus CUDA graphs equal eager. Skipped without CUDA."""


import pytest
import torch

from runtime_helpers import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
GRAPHS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def cpu_control(tiny_pair):
    return run(*tiny_pair)[0]


def outputs(rs):
    return [r.output_token_ids for r in rs]


def test_cuda_matches_cpu_float64(tiny_pair, cpu_control):
    out, _ = run(*tiny_pair, device="cuda")
    assert outputs(out) == outputs(cpu_control)
    assert [r.draft_steps for r in out] == [r.draft_steps for r in cpu_control]


@pytest.mark.parametrize("backend,steps", [("pytorch", 1), ("compiled", 1), ("pytorch", 4), ("compiled", 4),
                                           ("compiled+compiled-prefill", 1), ("compiled-prefill", 4)])
def test_cuda_graphs_equal_eager(tiny_pair, cpu_control, backend, steps):
    """steps: decode steps a launch (EngineConfig.steps_per_launch), one graph of four steps back to back beside
    each size's one-step graph, over the same inputs. compiled-prefill: the prefill's bucket compiled, then captured
    (its RoPE's float32 cos and sin may differ from eager's by a unit in the last place: the tiny target's peaked
    logits keep the same tokens)."""
    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import LLMEngine
    from runtime_helpers import prompts

    cfg = EngineConfig(str(tiny_pair[0]), str(tiny_pair[1]), ParallelConfig(1, 1, 1), CacheConfig(block_size=4, memory_bytes=2**22),
                       dtype="float64", device="cuda", cuda_graph_sizes=GRAPHS, max_model_len=256,
                       backend=backend, steps_per_launch=steps)
    with LLMEngine(cfg) as engine:
        first = engine.generate(prompts(), SamplingParams(seed=7, max_tokens=20))  # captures the prefill's bucket
        out = engine.generate(prompts(), SamplingParams(seed=7, max_tokens=20))  # replays it
        record = engine.graph_capture()
        ahead = engine.steps_ahead
    assert record["steps_per_launch"] == list(range(1, steps + 1))
    if steps > 1:
        assert record["launches_by_steps"].get(str(steps), 0) > 0, record
    assert ahead > 0  # async decode: graph steps launched before the last one was read, advanced on the device
    assert outputs(first) == outputs(out) == outputs(cpu_control)
    prefill = record["prefill"]
    assert prefill["status"] == "captured" and prefill["replays"] >= 1 and prefill["eager_chunks"] == 0, prefill
    assert prefill["compiled"] == ("compiled-prefill" in backend)
    assert record["mode"] == "FULL"  # not FULL_DECODE_ONLY: prefill ran from graphs too
    assert [r.draft_steps for r in out] == [r.draft_steps for r in cpu_control]
    assert record["status"] == "captured" and record["sizes"] == list(GRAPHS), record
    assert sum(record["replays"].values()) > 0 and record["eager_fallback_sizes"] == []


@pytest.mark.parametrize("backend,steps", [("pytorch", 1), ("compiled", 1), ("pytorch", 4)])
def test_requests_held_ready_take_rows_inside_graph_runs(tiny_pair, backend, steps):
    """prefill_ahead from graphs: 8 requests of different lengths on 3 rows, the next ones prefilled behind the launch
    in flight and held ready; a held request takes a finished one's row inside the run of graph launches, the draft
    context the graph packed is packed again for it, and every request's tokens, drafts and acceptance equal the
    CPU's."""
    from dataclasses import replace

    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import LLMEngine
    from runtime_helpers import prompts

    reqs = [replace(r, max_tokens=m) for r, m in zip(prompts(8), (20, 7, 1, 20, 3, 16, 9, 20))]
    cpu, _ = run(*tiny_pair, requests=reqs, max_num_seqs=3)
    cfg = EngineConfig(str(tiny_pair[0]), str(tiny_pair[1]), ParallelConfig(1, 1, 1), CacheConfig(block_size=4, memory_bytes=2**22),
                       dtype="float64", device="cuda", cuda_graph_sizes=GRAPHS, max_model_len=256, backend=backend,
                       steps_per_launch=steps, max_num_seqs=3, prefill_ahead=3)
    with LLMEngine(cfg) as engine:
        out = engine.generate(reqs, SamplingParams(seed=7, max_tokens=20))
        joined = engine.rows_joined
    assert joined >= 2
    keys = ("output_token_ids", "draft_steps", "accepted_per_position")
    assert [[getattr(r, k) for k in keys] for r in out] == [[getattr(r, k) for k in keys] for r in cpu]


@pytest.mark.parametrize("backend", ["pytorch", "compiled"])
def test_a_kept_full_stream_is_the_same_with_requests_held_ready(backend):
    """The shipped toy pair in float64 from CUDA graphs, 24 HumanEval prompts × 64 tokens on 8 rows (the benchmark's
    kept-full stream, shorter): with 7 requests held ready, a step a launch and four, every request's tokens and
    acceptance at each draft position equal the stream without (float64: batch composition changes nothing)."""
    from qual.corpus import load_corpus
    from qual.paths import DATA_DIR
    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import GenerationRequest, LLMEngine
    from qual.tokenize import PromptTokenizer

    toy = DATA_DIR / "models" / "toy"
    tok = PromptTokenizer(str(toy / "target"))
    reqs = [GenerationRequest(r.id, tuple(tok.encode(r.prompt)), 64) for r in load_corpus("humaneval").requests[:24]]
    got = {}
    for held, steps in [(0, 1), (7, 1), (7, 4)]:
        cfg = EngineConfig(str(toy / "target"), str(toy / "draft"), ParallelConfig(1, 1, 1),
                           CacheConfig(block_size=16, memory_bytes=1 << 30), dtype="float64", device="cuda",
                           cuda_graph_sizes=(1, 2, 4, 8), max_model_len=1024, max_num_seqs=8, backend=backend,
                           steps_per_launch=steps, prefill_ahead=held)
        with LLMEngine(cfg) as engine:
            out = engine.generate(reqs, SamplingParams(max_tokens=64, ignore_eos=True))
            assert (engine.rows_joined > 0) == (held > 0)
        got[held, steps] = [(r.output_token_ids, r.accepted_per_position) for r in out]
    assert got[7, 1] == got[0, 1] and got[7, 4] == got[0, 1]


def test_graph_bytes_are_the_same_for_identical_engines(tiny_pair):
    """Two identical engines one after the other in one process, as the two arms of a qual run: the second must
    not look cheaper because the caching allocator kept the first one's blocks (before graph bytes were measured
    from an emptied cache, two identical arms of `qual run --dcp 1 --device cuda --limit 64` recorded 822 MB and 159 MB)."""
    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import LLMEngine
    from runtime_helpers import prompts

    cfg = EngineConfig(str(tiny_pair[0]), str(tiny_pair[1]), ParallelConfig(1, 1, 1), CacheConfig(block_size=4, memory_bytes=2**22),
                       dtype="float32", device="cuda", cuda_graph_sizes=GRAPHS, max_model_len=256)
    torch.cuda.empty_cache()  # the first engine starts from an empty cache, as the first arm of a process does
    got = []
    for _ in range(2):
        with LLMEngine(cfg) as engine:
            engine.generate(prompts(2, max_tokens=8), SamplingParams(max_tokens=8))
            got.append(engine.graph_capture()["bytes"])
    assert got[0] > 0 and abs(got[0] - got[1]) <= 0.02 * got[0], got


def _pdl_or_skip(pdl: bool) -> None:
    from qual.runtime.backends import skinny_gemm

    if pdl and not (skinny_gemm.pdl_available() and torch.cuda.get_device_capability() >= (9, 0)):
        pytest.skip("PDL needs compute capability 9.0 and a Triton with gdc_wait")


@pytest.mark.parametrize("m,n,k", [(1, 4096, 1024), (8, 1024, 3072), (16, 100, 300), (3, 33, 129), (1, 4096, 14336)])
@pytest.mark.parametrize("pdl", [False, True])
def test_skinny_gemm_kernel_matches_float64(m, n, k, pdl):
    """Also launched with programmatic dependent launch: the same bits."""
    from qual.runtime.backends import skinny_gemm

    _pdl_or_skip(pdl)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    exact = x.double() @ w.double().T
    got = skinny_gemm.linear(x, w, pdl=pdl)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # float32 accumulation, one bf16 rounding at the end: within bf16's half-ulp of the exact product
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-3)
    if pdl:
        assert torch.equal(got, skinny_gemm.linear(x, w))


def _gluon_gemm():
    """qual/runtime/backends/gluon_gemm.py, or a skip where it cannot run (compute capability 9.0 and the Triton it is
    written in)."""
    from qual.runtime.backends import gluon_gemm

    if not (gluon_gemm.available() and torch.cuda.get_device_capability() >= (9, 0)):
        pytest.skip("needs compute capability 9.0 and the Triton the Gluon kernels are written in")
    return gluon_gemm


@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 6144, 4096, None), (8, 4096, 14336, None), (16, 28672, 4096, None), (3, 200, 328, (64, 64, 3, 2)),
    (5, 130, 4096, (128, 128, 7, 3)), (16, 640, 256, (256, 64, 1, 3)), (2, 64, 1000, (64, 64, 16, 6))])
@pytest.mark.parametrize("pdl", [False, True])
def test_gluon_products_match_float64(m, n, k, cfg, pdl):
    """The Gluon product's partials and its finishing form (residual added, column blocks summed by their last
    program) against float64: the 8B shape's products at choose_config, ragged column and K blocks (TMA reads zeros
    past the edges), more splits than K tiles a program; with PDL the same bits. Twice in a row: the finishing
    counts are left at zero."""
    gluon_gemm = _gluon_gemm()
    cfg = gluon_gemm.GluonConfig(*cfg) if cfg else None
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    res = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    exact = x.double() @ w.double().T
    got = gluon_gemm.partials(x, w, cfg, pdl=pdl)
    assert got.shape == ((cfg or gluon_gemm.choose_config(n, k)).split, m, n)
    torch.testing.assert_close(got.double().sum(0), exact, rtol=1e-5, atol=5e-4)  # float32 sums of exact products
    counts = torch.zeros(-(-n // 64), device="cuda", dtype=torch.int32)
    for _ in range(2):
        fin = gluon_gemm.finished(x, w, counts, res, 0.5, cfg, pdl=pdl)
        torch.testing.assert_close(fin.double(), 0.5 * exact + res.double(), rtol=2 ** -8, atol=1e-2)
        assert not counts.any()
    if pdl:
        assert torch.equal(got, gluon_gemm.partials(x, w, cfg))


@pytest.mark.parametrize("r,q,h,hk,d,s,splits", [
    (1, 1, 16, 8, 128, 192, 1), (8, 8, 16, 8, 128, 192, 1), (3, 8, 8, 1, 32, 70, 1),
    (1, 1, 16, 8, 128, 4000, 16), (2, 8, 16, 8, 128, 1000, 4), (3, 8, 8, 1, 32, 70, 2)])
def test_paged_attention_kernel_matches_gathered_reference(r, q, h, hk, d, s, splits):
    """Also long rows whose keys the default splits over several programs (key_splits on an H200: 16 and 4)."""
    from qual.runtime.attention import attention_with_lse
    from qual.runtime.backends.paged_attention import _programs_wanted, key_splits, paged_attention

    if s > 192:
        assert key_splits(_programs_wanted(torch.device("cuda")), r, hk, s) == splits

    g = torch.Generator(device="cuda").manual_seed(0)
    n = 4 * s
    qs = torch.randn(r, q, h, d, device="cuda", generator=g).bfloat16()
    kc = torch.randn(n, hk, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn(n, hk, d, device="cuda", generator=g).bfloat16()
    slots = torch.randint(0, n, (r, s), device="cuda", generator=g)
    mask = torch.rand(r, q, s, device="cuda", generator=g) > 0.3
    mask[0, 0] = False  # a row that sees nothing: out 0, lse -inf
    ref_out, ref_lse = attention_with_lse(qs.float(), kc[slots].float(), vc[slots].float(), mask, d ** -0.5)
    out, lse = paged_attention(qs, kc, vc, slots, mask, d ** -0.5, splits=None if s > 192 else splits)
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)  # bf16 output
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)  # float32 all the way


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("r,t,s,h,hk,d,masks", [
    (8, 512, 512, 8, 1, 32, "prefill"), (1, 128, 128, 8, 1, 32, "prefill"), (3, 40, 70, 16, 8, 128, "prefill"),
    (4, 8, 200, 16, 8, 128, "window"), (2, 8, 37, 8, 2, 64, "random"), (1, 1, 5, 4, 4, 16, "random")])
def test_fused_attention_matches_the_step_by_step_path(r, t, s, h, hk, d, masks, dtype):
    """attention_with_lse's one kernel (fused, on CUDA in half precision) against its step-by-step operators in
    float32 (where fused does not apply): padded
    prefill rectangles (causal over each row's length, padding queries that see nothing), a sliding window over a
    verify block, random masks; group sizes 8, 2, 4 and 1; odd key counts (the bias's padded stride)."""
    from qual.runtime.attention import attention_with_lse, fused_applies

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(r, t, h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(r, s, hk, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(r, s, hk, d, device="cuda", generator=g).to(dtype)
    keys = torch.arange(s, device="cuda")
    if masks == "prefill":  # row i holds a prompt of lens[i] tokens at positions 0.., then padding
        lens = torch.randint(1, min(t, s) + 1, (r,), device="cuda", generator=g)
        pos = torch.arange(t, device="cuda")
        mask = (keys[None, None, :] <= pos[None, :, None]) & (pos[None, :, None] < lens[:, None, None])
    elif masks == "window":  # the verify block's positions s - t .., each seeing the 64 keys up to itself
        pos = s - t + torch.arange(t, device="cuda")
        mask = ((keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - 64)).expand(r, t, s)
    else:
        mask = torch.rand(r, t, s, device="cuda", generator=g) > 0.4
        mask[0, 0] = False
    assert fused_applies(q, k, v) and not fused_applies(q.float(), k.float(), v.float())
    out, lse = attention_with_lse(q, k, v, mask, d ** -0.5, fused=True)
    ref_out, ref_lse = attention_with_lse(q.float(), k.float(), v.float(), mask, d ** -0.5, fused=True)
    assert out.dtype == lse.dtype == dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    blind = ~mask.any(dim=-1)
    if masks != "window":
        assert blind.any()  # rows that see nothing are in the matrix: out 0, lse -inf
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and torch.isinf(lse[blind]).all()
    assert not out.isnan().any() and (out[blind] == 0).all()
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].float(), ref_lse[finite], rtol=1e-2, atol=2e-2)  # rounded to dtype


@pytest.mark.parametrize("graph_tokens", [0, 4096])  # the eager prefill; the padded prefill from graphs
def test_half_precision_prefill_runs_fused_and_is_as_near_float64(graph_tokens, monkeypatch):
    """A bfloat16 prefill on CUDA runs its attention fused (TargetMeta.prefill): the shipped toy pair's prompt logits
    (its heads are 32 wide: the fused kernel applies; the tiny test pair's are not) are as near the CPU's float64
    ones as those of the step-by-step operators in bfloat16."""
    from qual.paths import DATA_DIR
    from qual.runtime import attention
    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig
    from qual.runtime.engine import LLMEngine

    toy = DATA_DIR / "models" / "toy"
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (3, 17, 40, 64, 90)]
    calls = []
    fused, applies = attention._fused_attention_with_lse, attention.fused_applies
    monkeypatch.setattr(attention, "_fused_attention_with_lse", lambda *a: calls.append(1) or fused(*a))

    def prompt_logits(device: str, dtype: str, step_by_step: bool = False):
        monkeypatch.setattr(attention, "fused_applies", (lambda *a: False) if step_by_step else applies)
        cfg = EngineConfig(str(toy / "target"), str(toy / "draft"), ParallelConfig(1, 1, 1),
                           CacheConfig(block_size=16, memory_bytes=2**24), dtype=dtype, device=device,
                           cuda_graph_sizes=(1,) if device == "cuda" else (), max_model_len=128,
                           prefill_graph_tokens=graph_tokens)
        with LLMEngine(cfg) as engine:
            logits = engine.prompt_logits(ps).double()
            record = engine.graph_capture()["prefill"]
        if device == "cuda":
            assert record["status"] == ("captured" if graph_tokens else "off"), record
        return logits

    exact = prompt_logits("cpu", "float64")
    base_error = (prompt_logits("cuda", "bfloat16", step_by_step=True) - exact).abs().max().item()
    assert not calls
    error = (prompt_logits("cuda", "bfloat16") - exact).abs().max().item()
    assert calls  # every layer's attention, once a chunk (and once more for a capture's warm-up)
    assert error <= 1.5 * base_error + 1e-3, (error, base_error)


@pytest.mark.parametrize("m,heads,kv,k,inter", [(1, 32, 8, 4096, 14336), (16, 32, 8, 4096, 14336), (3, 8, 1, 328, 200),
                                               (8, 4, 4, 1000, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pdl", [False, True])
def test_fused_layer_products_match_float64(m, heads, kv, k, inter, dtype, pdl):
    """fused-layer's four products against float64 (tests/fused_layer_reference.py) on the GPU: the 8B shape at 1 and
    16 rows, ragged column and K blocks, GQA groups 4, 8 and 1; each launched twice (the counts left at zero), with
    PDL the second time letting the next kernel launch after the weight stream (ProductConfig.late_launch); with
    PDL the same bits. Tolerance: two roundings to the dtype (rtol 2^-8 / 2^-11) over float32 sums."""
    from dataclasses import replace

    from qual.runtime.backends import fused_layer as fl
    from qual.runtime.models.layers import rope_inv_freq
    import fused_layer_reference as ref

    _pdl_or_skip(pdl)
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)  # noqa: E731
    D, eps = 128, 1e-6
    x, res, ln = rnd(m, k), rnd(m, k), (1 + rnd(k, scale=0.2).float()).to(dtype)
    wqkv, qkn = rnd((heads + 2 * kv) * D, k, scale=k**-0.5), (1 + rnd(heads + kv, D, scale=0.2).float()).to(dtype)
    wo, gu, wd = rnd(k, heads * D, scale=(heads * D) ** -0.5), rnd(2 * inter, k, scale=k**-0.5), rnd(k, inter,
                                                                                                   scale=inter**-0.5)
    positions = torch.arange(1000, 1000 + m, device="cuda")
    slots = torch.randperm(4 * m, device="cuda", generator=g)[:m]
    inv_freq = rope_inv_freq(D, 1e6, "cuda")
    rtol = 2**-8 if dtype == torch.bfloat16 else 2**-11
    counts = torch.zeros(1024, device="cuda", dtype=torch.int32)
    got = []
    for late in (False, pdl):
        cfg = lambda choose, w, *head: replace(choose(*w.shape, *head), late_launch=late)  # noqa: E731
        kc, vc = torch.zeros(4 * m, kv, D, device="cuda", dtype=dtype), torch.zeros(4 * m, kv, D, device="cuda", dtype=dtype)
        q = fl.qkv_product(x, ln, eps, wqkv, qkn, positions, inv_freq, slots, kc, vc, heads, kv, counts,
                           cfg(fl.qkv_config, wqkv, D), pdl=pdl)
        o = fl.residual_product(q, wo, res, counts, cfg(fl.residual_config, wo), pdl=pdl)
        act = fl.swiglu_product(x, ln, eps, gu, counts, cfg(fl.swiglu_config, gu), pdl=pdl)
        down = fl.residual_product(act, wd, res, counts, cfg(fl.residual_config, wd), pdl=pdl)
        assert not counts.any()
        got.append((q, kc, vc, o, act, down))
    q, kc, vc, o, act, down = got[1]
    eq, ek, ev = ref.qkv(x, ln, eps, wqkv, qkn, positions, inv_freq, heads, kv)
    for name, a, b in [("q", q.view(m, heads, D), eq), ("k", kc[slots], ek), ("v", vc[slots], ev),
                       ("o", o, ref.residual(q, wo, res)), ("swiglu", act, ref.swiglu(x, ln, eps, gu)),
                       ("down", down, ref.residual(act, wd, res))]:
        # two roundings: x * ln at the load and the output (an emulation of the kernel's math in float64 puts the
        # largest error at up to 1.22 x rtol x the largest magnitude over these shapes)
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=2 * rtol * b.abs().max().item(), msg=name)
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[1]))  # the split order is fixed: the same bits
    if pdl:
        kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
        assert torch.equal(q, fl.qkv_product(x, ln, eps, wqkv, qkn, positions, inv_freq, slots, kc2, vc2, heads, kv,
                                             counts))
        assert torch.equal(kc, kc2) and torch.equal(down, fl.residual_product(act, wd, res, counts))


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("pdl", [False, True])
def test_gluon_layer_products_match_float64(m, pdl):
    """gluon-layer's products (qual/runtime/backends/gluon_layer.py) at the 8B shape against float64: o with the
    residual and x * ln for the next norm (that product rounded from the new residual, as the Triton path rounds
    it), qkv (q/k norm, RoPE, KV at each row's slot) and SwiGLU (gate/up read in place as two half tiles a stage)
    from it; twice, the counts left at zero; with PDL the same bits."""
    _gluon_gemm()
    import fused_layer_reference as ref
    from qual.runtime.backends import gluon_layer as gf
    from qual.runtime.models.layers import rope_inv_freq

    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()  # noqa: E731
    H, I, NH, NKV, D, eps = 4096, 14336, 32, 8, 128, 1e-6
    a, res, ln = rnd(m, NH * D), rnd(m, H), (1 + rnd(H, scale=0.2).float()).bfloat16()
    wo, gu = rnd(H, NH * D, scale=(NH * D) ** -0.5), rnd(2 * I, H, scale=H**-0.5)
    wqkv, qkn = rnd((NH + 2 * NKV) * D, H, scale=H**-0.5), (1 + rnd(NH + NKV, D, scale=0.2).float()).bfloat16()
    positions, inv_freq = torch.arange(5000, 5000 + m, device="cuda"), rope_inv_freq(D, 1e6, "cuda")
    slots = torch.randperm(64, device="cuda", generator=g)[:m]
    counts = torch.zeros(1024, device="cuda", dtype=torch.int32)
    runs = []
    for launch in range(2 + pdl):
        p = pdl and launch < 2
        kc, vc = torch.zeros(64, NKV, D, device="cuda").bfloat16(), torch.zeros(64, NKV, D, device="cuda").bfloat16()
        x, x_ln = gf.residual_product(a, wo, res, counts, ln, pdl=p)
        q = gf.qkv_product(x_ln, x, eps, wqkv, qkn, positions, inv_freq, slots, kc, vc, NH, NKV, counts, pdl=p)
        act = gf.swiglu_product(x_ln, x, eps, gu, counts, pdl=p)
        assert not counts.any()
        runs.append((x, x_ln, q, kc, vc, act))
    x, x_ln, q, kc, vc, act = runs[0]
    assert torch.equal(x_ln, (x.float() * ln.float()).bfloat16())
    eq, ek, ev = ref.qkv(x, ln, eps, wqkv, qkn, positions, inv_freq, NH, NKV)
    for name, got, exact in [("o", x, ref.residual(a, wo, res)), ("q", q.view(m, NH, D), eq), ("k", kc[slots], ek),
                             ("v", vc[slots], ev), ("swiglu", act, ref.swiglu(x, ln, eps, gu))]:
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=2**-7 * exact.abs().max().item(), msg=name)
    assert all(torch.equal(u, v) for r in runs[1:] for u, v in zip(runs[0], r))  # fixed split order; PDL: same bits


@pytest.fixture(scope="module")
def head32_pair(tmp_path_factory):
    """The tiny pair with 32-wide heads (fused-layer's qkv product takes a head as one column block of >= 32)."""
    from checkpoints import make_draft, make_target

    root = tmp_path_factory.mktemp("head32")
    return make_target(root / "target", head_dim=32), make_draft(root / "draft", head_dim=32)


@pytest.mark.parametrize("backend", ["fused-layer+triton-attention", "compiled+fused-layer+triton-attention+pdl"])
def test_fused_layer_in_graphs_equals_eager_and_the_per_layer_path(head32_pair, backend):
    """fused-layer serves decode and verify steps (a DFlash drafter's blocks) from the decode graphs as eagerly, and
    gives the per-layer path's greedy tokens (bf16; the products round once where that path rounds each step)."""
    if "pdl" in backend:
        _pdl_or_skip(True)
    from runtime_helpers import prompts

    common = dict(dtype="bfloat16", device="cuda", max_model_len=256, requests=prompts()[:2])
    eager, _ = run(*head32_pair, static_shapes=True, backend=backend, **common)
    graphs, _ = run(*head32_pair, cuda_graph_sizes=GRAPHS, backend=backend, **common)
    per_layer, _ = run(*head32_pair, cuda_graph_sizes=GRAPHS, backend="triton-attention", **common)
    assert outputs(graphs) == outputs(eager) == outputs(per_layer), backend
    assert [r.draft_steps for r in graphs] == [r.draft_steps for r in eager], backend


@pytest.fixture(scope="module")
def head64_pair(tmp_path_factory):
    """The tiny pair with 64-wide heads (gluon-layer's qkv product takes a head as one column block of 64 or 128)."""
    from checkpoints import make_draft, make_target

    root = tmp_path_factory.mktemp("head64")
    return make_target(root / "target", head_dim=64), make_draft(root / "draft", head_dim=64)


@pytest.mark.parametrize("backend", ["gluon-layer+triton-attention", "compiled+gluon-layer+triton-attention+pdl"])
def test_gluon_layer_in_graphs_equals_eager_and_the_per_layer_path(head64_pair, backend):
    """gluon-layer serves decode and verify steps from the decode graphs as eagerly (its TMA descriptors built at
    capture, its counts back at zero for each replay), and gives the per-layer path's and fused-layer's greedy
    tokens (bf16)."""
    _gluon_gemm()
    if "pdl" in backend:
        _pdl_or_skip(True)
    from runtime_helpers import prompts

    common = dict(dtype="bfloat16", device="cuda", max_model_len=256, requests=prompts()[:2])
    eager, _ = run(*head64_pair, static_shapes=True, backend=backend, **common)
    graphs, _ = run(*head64_pair, cuda_graph_sizes=GRAPHS, backend=backend, **common)
    per_layer, _ = run(*head64_pair, cuda_graph_sizes=GRAPHS, backend="triton-attention", **common)
    fused, _ = run(*head64_pair, cuda_graph_sizes=GRAPHS, backend="fused-layer+triton-attention", **common)
    assert outputs(graphs) == outputs(eager) == outputs(per_layer) == outputs(fused), backend
    assert [r.draft_steps for r in graphs] == [r.draft_steps for r in eager], backend


@pytest.mark.parametrize("kernel", ["triton-gemm", "triton-attention", "triton-gemm+triton-attention+pdl"])
def test_triton_kernels_in_graphs_equal_them_eager(tiny_pair, kernel):
    """Each Triton kernel captures into the decode graphs (also compiled) and replays what it computes eagerly;
    with pdl, launched with programmatic dependent launch (compiled: inductor's kernels too).

    bfloat16 rounding depends on shapes, so the eager run uses the graphs' padded static shapes."""
    _pdl_or_skip("pdl" in kernel)
    from runtime_helpers import prompts

    common = dict(dtype="bfloat16", device="cuda", max_model_len=256, requests=prompts()[:2])
    for backend in (kernel, f"compiled+{kernel}"):
        eager, _ = run(*tiny_pair, static_shapes=True, backend=backend, **common)
        graphs, _ = run(*tiny_pair, cuda_graph_sizes=GRAPHS, backend=backend, **common)
        assert outputs(graphs) == outputs(eager), backend
        assert [r.draft_steps for r in graphs] == [r.draft_steps for r in eager], backend


def test_every_backend_part_runs_on_a_hopper_gpu():
    """qual doctor's "runtime backends" line: on a GPU of compute capability 9.0 or later with Triton, no part is
    refused."""
    from qual.runtime.backends import PARTS, part_problems

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("pdl needs compute capability 9.0")
    assert part_problems("cuda") == dict.fromkeys(PARTS)


@pytest.mark.parametrize("change,backend", [({}, "fused"), ({"poll_acquire": False}, "fused"), ({}, "compiled+fused")])
def test_fused_decode_matches_per_layer_path(tiny_pair, change, backend, monkeypatch):
    """One kernel for all layers (batch 1, graphs on, float32) gives the per-layer path's tokens; no barrier timed out.
    change: the default tiling, then the other barrier poll; compiled+fused: the step around the kernel compiled."""
    from dataclasses import replace

    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import LLMEngine
    from qual.runtime.backends.decode_layers import Tiling
    from runtime_helpers import prompts

    for_shape = Tiling.for_shape
    monkeypatch.setattr(Tiling, "for_shape", lambda *a, **k: replace(for_shape(*a, **k), **change))

    def generate(fused):
        cfg = EngineConfig(str(tiny_pair[0]), None, ParallelConfig(1, 1, 1), CacheConfig(block_size=4, memory_bytes=2**22),
                           dtype="float32", device="cuda", cuda_graph_sizes=(1, 2), max_model_len=256,
                           backend=backend if fused else "pytorch")
        with LLMEngine(cfg) as engine:
            out = [engine.generate([r], SamplingParams(max_tokens=20))[0].output_token_ids for r in prompts()]
            kernel = engine.runner.target.fused
            return out, engine.graph_capture(), kernel and (kernel.flags.tolist(), kernel.programs, len(engine.runner.target.layers))

    ref, _, _ = generate(False)
    got, record, (flags, programs, layers) = generate(True)
    assert got == ref
    assert record["status"] == "captured" and record["replays"].get("1", 0) > 0, record
    from qual.runtime.backends.decode_layers import PHASES_PER_LAYER

    assert flags == [programs * PHASES_PER_LAYER * layers, 0]  # every program met every barrier of the last step


@two_gpus
def test_nccl_dcp2_matches_dcp1_with_graphs(tiny_pair, cpu_control):
    out, _ = run(*tiny_pair, tp=2, dcp=2, device="cuda", cuda_graph_sizes=GRAPHS, max_model_len=256)
    assert outputs(out) == outputs(cpu_control)
    assert [r.draft_steps for r in out] == [r.draft_steps for r in cpu_control]


@two_gpus
def test_nccl_dcp2_interleave2_and_sharded(tiny_pair, cpu_control):
    out, _ = run(*tiny_pair, tp=2, dcp=2, interleave=2, device="cuda")
    assert outputs(out) == outputs(cpu_control)
    legacy, _ = run(*tiny_pair, tp=2, dcp=2, draft_kv="sharded", device="cuda")
    assert outputs(legacy) == outputs(cpu_control)
    assert [r.draft_steps for r in legacy] != [r.draft_steps for r in cpu_control]
