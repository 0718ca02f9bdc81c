"""GLM-5.3-Flash through the paged runtime: transformers as the oracle at DCP 1, DCP N == DCP 1 in exact mode,
union mode, per-rank memory by cache group, and the configurations it refuses.

float64 on the CPU; the checkpoints are random tiny ones written by transformers' save_pretrained.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from checkpoints import make_draft
from glm5_checkpoints import make_glm5, oracle, oracle_forward, single_thread, tiny_text  # noqa: F401
from qual.errors import QualError
from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine, validate

pytestmark = pytest.mark.slow  # engine processes and whole runs: scheduled first (tests/conftest.py)

KDA, MLA = "linear_attention", "indexed_attention"
# Prompts of 5-41 tokens: the longest hold 10 pools of 4 where 2 are selected (index_topk 8), so sparse selection
# drops keys; the shortest fits the top-k entirely.
LENGTHS = (5, 41, 13)


def prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5rt")
    target = make_glm5(root / "default", tiny_text())  # KDA, KDA, KDA, MLA+DSA; dense x3 then MoE; 4 streams
    shared = make_glm5(root / "shared", tiny_text(  # a shared indexer layer, all-MoE, one stream
        layer_types=[KDA, MLA, MLA, KDA], indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["sparse"] * 4, hc_mult=1), seed=1)
    draft = make_draft(root / "draft", vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=8, intermediate_size=48, target_layer_ids=(0, 2), block_size=4)
    return {"default": target, "shared": shared, "draft": draft}


def engine_run(target, draft=None, tp=1, dcp=1, interleave=1, dsa_topk="exact", lengths=LENGTHS, max_tokens=12,
               dtype="float64", logits=True):
    cfg = EngineConfig(str(target), str(draft) if draft else None, ParallelConfig(tp, dcp, interleave),
                       CacheConfig(block_size=4, memory_bytes=2**26), dtype=dtype, dsa_topk=dsa_topk,
                       max_model_len=max(lengths) + max_tokens + 8)
    reqs = [GenerationRequest(f"r{i}", tuple(p), max_tokens) for i, p in enumerate(prompts(lengths))]
    with LLMEngine(cfg) as engine:
        out = engine.generate(reqs, SamplingParams(max_tokens=max_tokens))
        lg = engine.prompt_logits(prompts(lengths)) if logits else None
        memory = engine.memory()
    assert [p.exitcode for p in engine.workers] == [0] * (tp - 1)
    return out, lg, memory


@pytest.fixture(scope="module")
def control(ckpts):
    """DCP 1, speculative decoding with a random drafter (verify steps of 4 tokens: the KDA commit is exercised)."""
    return engine_run(ckpts["default"], ckpts["draft"])


def test_the_tail_ring_takes_each_slot_once_whatever_order_duplicate_writes_land(ckpts, control, monkeypatch):
    """A prefill longer than the index-key tail ring (8 slots here; prompts of 13 and 41 tokens) stores only each
    request's last `ring` positions. Writing every position made slots repeat within one index_copy_, whose winner a
    GPU leaves unspecified: on one H200 the first engine of a process sometimes kept an early position's key, and under
    compute-sanitizer always did, giving request r1 other tokens from its sixth on. Here the duplicates' order is
    reversed (first write wins) and nothing may change."""
    from qual.runtime.paged import VectorStore

    write = VectorStore.write
    monkeypatch.setattr(VectorStore, "write", lambda self, layer, routed, x: write(self, layer, routed.flip(0), x.flip(0)))
    out, _, _ = engine_run(ckpts["default"], ckpts["draft"], logits=False)
    assert [r.output_token_ids for r in out] == [r.output_token_ids for r in control[0]]


def test_no_step_writes_a_cache_slot_twice(ckpts, monkeypatch):
    """Every cache write of a step (prefill and verify; MLA latents, pooled index keys, the tail ring, KDA states, the
    drafter's K/V) names each real slot at most once: the order of duplicate writes is nobody's to rely on."""
    from qual.runtime import paged

    def checked(write):
        def run(self, layer, slots, *values):
            real = slots[slots != self.trash]
            assert real.numel() == real.unique().numel(), f"{type(self).__name__} slots written twice: {real.tolist()}"
            return write(self, layer, slots, *values)
        return run

    for store in (paged.KVStore, paged.VectorStore, paged.StateStore):
        monkeypatch.setattr(store, "write", checked(store.write))
    engine_run(ckpts["default"], ckpts["draft"], logits=False)


@pytest.mark.parametrize("name", ["default", "shared"])
def test_prompt_logits_and_greedy_tokens_match_transformers(ckpts, name):
    out, lg, _ = engine_run(ckpts[name], max_tokens=4)
    model = oracle(ckpts[name])
    for p, row, r in zip(prompts(), lg, out):
        seq = list(p)
        for _ in range(4):  # greedy by full recomputation: the oracle has no cache to share our mistakes
            seq.append(int(oracle_forward(model, torch.tensor(seq))[-1].argmax()))
        assert r.output_token_ids == seq[len(p):]
        torch.testing.assert_close(row, oracle_forward(model, torch.tensor(p))[-1], rtol=0, atol=1e-9)


def test_speculative_decoding_is_lossless(ckpts, control):
    plain, _, _ = engine_run(ckpts["default"], logits=False)
    assert [r.output_token_ids for r in control[0]] == [r.output_token_ids for r in plain]
    assert sum(r.drafts for r in control[0]) > 0


@pytest.fixture(scope="module")
def dflash2_draft(tmp_path_factory):
    """A DFlash2 drafter with a sliding layer (window 3 < its block of 4) and a full one, on the GLM target's width."""
    from qual.checkpoints.dflash import DFlash2Params

    return make_draft(tmp_path_factory.mktemp("glm5d2") / "draft", vocab_size=97, hidden_size=32, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=8, intermediate_size=48, target_layer_ids=(0, 2), block_size=4,
                      layer_types=("sliding_attention", "full_attention"), sliding_window=3,
                      options={"dflash2": DFlash2Params(conv_kernel_size=3, conv_group_size=8, selector_rank=4,
                                                        selector_top_k=4)})


def test_dflash2_with_sliding_layers_on_hyper_connection_aux_states(ckpts, control, dflash2_draft):
    """Aux features of the GLM target (its streams contracted after each target layer) drive a DFlash2 drafter:
    speculative decoding stays lossless (the control's tokens are plain decoding's, test above), and DCP 2 gives
    DCP 1's tokens and proposals."""
    one, _, _ = engine_run(ckpts["default"], dflash2_draft, logits=False)
    two, _, _ = engine_run(ckpts["default"], dflash2_draft, tp=2, dcp=2, logits=False)
    plain = control[0]
    assert [r.output_token_ids for r in one] == [r.output_token_ids for r in plain] == [r.output_token_ids for r in two]
    assert [r.draft_steps for r in two] == [r.draft_steps for r in one] and sum(r.drafts for r in one) > 0


LAYOUTS = [(2, 2, 1), (2, 2, 2), (2, 4, 1), (2, 4, 2), (4, 4, 1), (4, 4, 2)]  # (dcp, tp, interleave); 4 heads: tp <= 4


@pytest.mark.parametrize("dcp,tp,interleave", LAYOUTS, ids=[f"dcp{d}-tp{t}-i{i}" for d, t, i in LAYOUTS])
def test_exact_dsa_under_dcp_equals_dcp1(ckpts, control, dcp, tp, interleave):
    """Tokens, proposals and prompt logits of DCP N (exact top-k) equal DCP 1, on contexts longer than the top-k."""
    out, lg, _ = engine_run(ckpts["default"], ckpts["draft"], tp=tp, dcp=dcp, interleave=interleave)
    base, base_lg, _ = control
    assert [r.output_token_ids for r in out] == [r.output_token_ids for r in base]
    assert [r.draft_steps for r in out] == [r.draft_steps for r in base]
    torch.testing.assert_close(lg, base_lg, rtol=0, atol=1e-10)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A target whose first layer selects: its index keys depend on the tokens alone, so prompts repeating a
    4-token pattern (one pool) hold many pools with equal true scores, a tie at the k-th pool in every query."""
    root = tmp_path_factory.mktemp("glm5tie")
    target = make_glm5(root / "target", tiny_text(layer_types=[MLA, KDA, MLA, KDA], indexer_types=["full"] * 4,
                                                  index_n_heads=4))
    draft = make_draft(root / "draft", vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=8, intermediate_size=48, target_layer_ids=(0, 2), block_size=4)
    pattern = [[42, 65, 74, 92], [2, 69, 95, 64], [87, 95, 67, 30]]
    prompts = [pattern[0] * n for n in (9, 10, 11, 13)] + [pattern[1] * 7 + [3], pattern[2] * 12]
    return target, draft, prompts


def selections(monkeypatch, target, draft, prompts, tp, dcp, dtype):
    """(tokens and proposals per request, the pools every full layer selected at every step, the smallest gap
    between the k-th and the (k+1)-th candidate over those steps) of one engine run."""
    from qual.runtime.models.glm5 import target as glm5_target
    from qual.runtime.models.glm5 import topk

    picked, gaps = [], []
    attended, topk_pools = glm5_target.Glm5Target._attended, topk.topk_pools

    def record_pools(self, pools, *args):
        picked.append(pools.clone())  # rank 0 runs in this process; under exact mode every rank selects these
        return attended(self, pools, *args)

    def record_gap(scores, ids, valid, k):
        s, i = topk_pools(scores, ids, valid, k + 1)
        both = (i[:, k - 1] >= 0) & (i[:, k] >= 0)
        gaps.append((s[:, k - 1] - s[:, k])[both])
        return s[:, :k], i[:, :k]

    monkeypatch.setattr(glm5_target.Glm5Target, "_attended", record_pools)
    monkeypatch.setattr(glm5_target, "local_topk", record_gap)
    cfg = EngineConfig(str(target), str(draft), ParallelConfig(tp, dcp, 1), CacheConfig(block_size=4, memory_bytes=2**26),
                       dtype=dtype, max_model_len=96)
    with LLMEngine(cfg) as engine:
        out = engine.generate([GenerationRequest(f"r{i}", tuple(p), 10) for i, p in enumerate(prompts)],
                              SamplingParams(max_tokens=10))
    monkeypatch.undo()
    return [(r.output_token_ids, r.draft_steps) for r in out], picked, float(torch.cat(gaps).min())


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_exact_dcp_selects_dcp1s_pools_bit_for_bit_through_near_ties(tied, monkeypatch, dtype):
    """Every selection of every step equals DCP 1's at DCP 2 and 4 although the k-th and (k+1)-th pools tie; tokens,
    proposals and accepted positions too. Each rank scoring its pools with a GEMM of its own shape picked other
    pools here (float64 at DCP 2 and 4, float32 at DCP 2 and 4, on the 2-core Xeon that runs the suite)."""
    base, base_pools, gap = selections(monkeypatch, *tied, 4, 1, dtype)
    assert gap == 0  # the k-th pool is tied: the tie-break decides
    for dcp in (2, 4):
        out, pools, _ = selections(monkeypatch, *tied, 4, dcp, dtype)
        assert out == base and sum(len(steps) for _, steps in out) > 0
        assert len(pools) == len(base_pools) and all(torch.equal(a, b) for a, b in zip(pools, base_pools)), dcp


@pytest.fixture(scope="module")
def tied_tp8(tmp_path_factory):
    """A target with three full indexer layers after MLA layers (MLA, KDA, MLA, MLA, MLA; every indexer full), 8
    heads (TP 8 takes DCP 1, 2, 4 and 8), and prompts repeating a pool-sized pattern: the first layer's index keys
    depend on the tokens alone, so its pools tie, and later layers' ReLU sums tie at zero."""
    root = tmp_path_factory.mktemp("glm5tp8")
    heads = dict(num_attention_heads=8, num_key_value_heads=8, linear_num_heads=8)
    target = make_glm5(root / "target", tiny_text(layer_types=[MLA, KDA, MLA, MLA, MLA], indexer_types=["full"] * 5,
                                                  mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"],
                                                  num_hidden_layers=5, index_n_heads=4, **heads))
    draft = make_draft(root / "draft", vocab_size=97, hidden_size=32, num_attention_heads=8, num_key_value_heads=1,
                       head_dim=8, intermediate_size=48, target_layer_ids=(0, 2), block_size=4, num_target_layers=5)
    pattern = [[42, 65, 74, 92], [2, 69, 95, 64], [87, 95, 67, 30]]
    return target, draft, [pattern[0] * 9, pattern[0] * 12, pattern[1] * 7 + [3], pattern[2] * 11]


def invariant_run(monkeypatch, target, draft, prompts, dcp, dtype, tp=8, device="cpu"):
    """(tokens and proposals per request, the pools every full layer selected at every step, {layer: the smallest
    gap between the k-th and the (k+1)-th candidate}, prompt logits) of one engine (on CUDA: decode replayed from
    CUDA graphs)."""
    from qual.runtime.models.glm5 import target as glm5_target
    from qual.runtime.models.glm5 import topk

    picked, gaps, layer = [], {}, []
    select, attended, topk_pools = glm5_target.Glm5Target._select, glm5_target.Glm5Target._attended, topk.topk_pools

    def at_layer(self, i, *args):
        layer[:] = [i]
        return select(self, i, *args)

    def record_pools(self, pools, *args):
        picked.append(pools.clone())  # rank 0 runs in this process; under exact mode every rank selects these
        return attended(self, pools, *args)

    def record_gap(scores, ids, valid, k):
        s, i = topk_pools(scores, ids, valid, k + 1)
        both = (i[:, k - 1] >= 0) & (i[:, k] >= 0)
        gaps.setdefault(layer[0], []).append((s[:, k - 1] - s[:, k])[both])
        return s[:, :k], i[:, :k]

    monkeypatch.setattr(glm5_target.Glm5Target, "_select", at_layer)
    monkeypatch.setattr(glm5_target.Glm5Target, "_attended", record_pools)
    monkeypatch.setattr(glm5_target, "local_topk", record_gap)
    cfg = EngineConfig(str(target), str(draft), ParallelConfig(tp, dcp, 1, "invariant"),
                       CacheConfig(block_size=4, memory_bytes=2**26), dtype=dtype, max_model_len=64, device=device,
                       cuda_graph_sizes=(1, 2, 4) if device == "cuda" else None)
    with LLMEngine(cfg) as engine:
        out = engine.generate([GenerationRequest(f"r{i}", tuple(p), 4) for i, p in enumerate(prompts)],
                              SamplingParams(max_tokens=4))
        lg = engine.prompt_logits(prompts)
    monkeypatch.undo()
    picked = [p.cpu() for p in picked]
    return ([(r.output_token_ids, r.draft_steps) for r in out], picked,
            {i: float(torch.cat(g).min()) if torch.cat(g).numel() else float("inf") for i, g in gaps.items()}, lg)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_invariant_merge_makes_dcp_n_dcp_1_bit_for_bit_through_every_layer(tied_tp8, monkeypatch, dtype):
    """dcp_comm invariant at TP 8: DCP 2, 4 and 8 give DCP 1's prompt logits bit for bit, its tokens and proposals,
    and its selection at every step of every full indexer layer, the k-th and (k+1)-th pools tied in the first
    layer and in a full layer after MLA layers (the a2a merge's DCP N logits differ from its DCP 1's in float32 here:
    1.4e-6 to 2.7e-6 at DCP 2, 4 and 8; tests/test_dcp_invariant.py shows that merge's rounding differ)."""
    base, base_pools, gaps, base_lg = invariant_run(monkeypatch, *tied_tp8, 1, dtype)
    assert gaps[0] == 0 and min(gaps[i] for i in (2, 3, 4)) == 0, gaps  # ties: the tie-break decides
    for dcp in (2, 4, 8):
        out, pools, _, lg = invariant_run(monkeypatch, *tied_tp8, dcp, dtype)
        assert torch.equal(lg, base_lg), dcp
        assert out == base and sum(len(steps) for _, steps in out) > 0
        assert len(pools) == len(base_pools) and all(torch.equal(a, b) for a, b in zip(pools, base_pools)), dcp


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL takes one rank per GPU)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_invariant_merge_on_gpus_over_nccl(tied_tp8, monkeypatch, dtype):
    """The same on CUDA ranks over NCCL, decode replayed from CUDA graphs: TP = the GPUs (2, 4 or 8), DCP 1 against
    every DCP size up to it."""
    tp = 1 << (min(torch.cuda.device_count(), 8).bit_length() - 1)
    base, base_pools, _, base_lg = invariant_run(monkeypatch, *tied_tp8, 1, dtype, tp=tp, device="cuda")
    for dcp in (d for d in (2, 4, 8) if d <= tp):
        out, pools, _, lg = invariant_run(monkeypatch, *tied_tp8, dcp, dtype, tp=tp, device="cuda")
        assert torch.equal(lg, base_lg), dcp
        assert out == base and all(torch.equal(a, b) for a, b in zip(pools, base_pools)), dcp


def test_union_attends_another_set_beyond_the_top_k_and_the_same_within_it(ckpts, control):
    union, lg, _ = engine_run(ckpts["default"], ckpts["draft"], tp=4, dcp=4, dsa_topk="union")
    _, base_lg, _ = control
    diff = (lg - base_lg).abs().max(-1).values  # per prompt
    assert diff[0] < 1e-10  # 5 tokens: one pool and a tail, within the top-k: the same set
    assert diff[1] > 1e-6  # 41 tokens: each rank's local top-k, unioned, is more than the global top-k
    # Contexts of at most 9 tokens (prompts + 4 generated) hold at most the 2 pools the top-k selects.
    short, short_lg, _ = engine_run(ckpts["default"], tp=4, dcp=4, dsa_topk="union", lengths=(3, 5, 4), max_tokens=4)
    exact, exact_lg, _ = engine_run(ckpts["default"], tp=4, dcp=4, lengths=(3, 5, 4), max_tokens=4)
    assert [r.output_token_ids for r in short] == [r.output_token_ids for r in exact]
    torch.testing.assert_close(short_lg, exact_lg, rtol=0, atol=1e-10)


def test_memory_per_rank_by_cache_group(ckpts):
    """A 2,048-token prompt: at DCP 4 the latent and index-key groups hold <= 0.26x their DCP 1 bytes; the KDA
    state is the same at every DCP size and every prompt length."""
    def peaks(dcp, n):
        _, _, memory = engine_run(ckpts["default"], tp=4, dcp=dcp, lengths=(n,), max_tokens=2, dtype="float32",
                                  logits=False)
        return {name: g["peak_bytes"] for name, g in memory.items()}

    one, four, short = peaks(1, 2048), peaks(4, 2048), peaks(4, 256)
    for group in ("latent", "index"):
        assert 0 < four[group] <= 0.26 * one[group], (group, four[group], one[group])
    assert one["kda"] == four["kda"] == short["kda"] > 0
    assert one["index_tail"] == four["index_tail"] == short["index_tail"] > 0  # replicated, one ring a request


def test_configurations_it_refuses(ckpts, tmp_path):
    target = str(ckpts["default"])
    with pytest.raises(QualError, match="tp % dcp == 0 violated"):
        ParallelConfig(4, 3)
    with pytest.raises(QualError, match="tp % dcp == 0 violated"):  # dcp larger than tp
        ParallelConfig(2, 4)
    with pytest.raises(QualError, match="num_attention_heads=4 is not divisible by tp=8"):
        validate(EngineConfig(target, parallel=ParallelConfig(8, 8)))
    with pytest.raises(QualError, match="the GLM-5 target runs the reference backend only"):
        LLMEngine(EngineConfig(target, backend="compiled"))
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((ckpts["default"] / "config.json").read_text())
    cfg["text_config"]["glide_path"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QualError, match="unsupported key 'glide_path'"):
        validate(EngineConfig(str(bad)))


def test_qual_generate_and_image_inputs(ckpts, control, tmp_path):
    """`qual generate` prints what the engine computes (DCP 2 here), and refuses image inputs by name."""
    lines = [json.dumps({"id": f"r{i}", "prompt_token_ids": p}) for i, p in enumerate(prompts())]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "qual", "generate", "--target", ckpts["default"], "--draft", ckpts["draft"],
           "--prompts", tmp_path / "p.jsonl", "--tp", "2", "--dcp", "2", "--max-tokens", "12", "--dtype", "float64"]
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [g["output_token_ids"] for g in got] == [r.output_token_ids for r in control[0]]
    (tmp_path / "img.jsonl").write_text(json.dumps({"id": "a", "prompt": "x", "images": ["cat.png"]}) + "\n")
    cmd[cmd.index("--prompts") + 1] = tmp_path / "img.jsonl"
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "image inputs are not supported" in proc.stderr


def cuda_run(ckpts, dtype, graphs=(1, 2, 4)):
    cfg = EngineConfig(str(ckpts["default"]), str(ckpts["draft"]), ParallelConfig(1, 1, 1),
                       CacheConfig(block_size=4, memory_bytes=2**26), dtype=dtype, device="cuda",
                       cuda_graph_sizes=graphs, max_model_len=max(LENGTHS) + 20)
    reqs = [GenerationRequest(f"r{i}", tuple(p), 12) for i, p in enumerate(prompts())]
    with LLMEngine(cfg) as engine:
        out = engine.generate(reqs, SamplingParams(max_tokens=12))
        lg = engine.prompt_logits(prompts())
        record = engine.graph_capture()
    return out, lg.double().cpu(), record


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_in_float64_equals_cpu_eager(ckpts, control):
    """Decode steps replayed from CUDA graphs (the MoE runs every expert inside them) give the CPU's tokens and
    proposals; prompt logits equal to 1e-9."""
    out, lg, record = cuda_run(ckpts, "float64")
    assert record["status"] == "captured" and record["sizes"] == [1, 2, 4], record
    assert sum(record["replays"].values()) > 0 and record["eager_fallback_sizes"] == [], record
    assert [(r.output_token_ids, r.draft_steps) for r in out] == [(r.output_token_ids, r.draft_steps) for r in control[0]]
    torch.testing.assert_close(lg, control[1], rtol=0, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_float32_prompt_logits_near_transformers(ckpts):
    _, lg, _ = cuda_run(ckpts, "float32", graphs=())
    model = oracle(ckpts["default"])
    worst = max(float((row - oracle_forward(model, torch.tensor(p))[-1]).abs().max()) for p, row in zip(prompts(), lg))
    print(f"float32 on CUDA: largest |logit - transformers float64| = {worst:.2e}")
    assert worst < 1e-3
