"""GLM-5.3-Flash configurations as users bring them: tiny random `glm5_next` models written by transformers, each
decoded greedily in float64 by transformers and by `qual generate` at TP 1 / DCP 1, TP 2 / DCP 2 and TP 4 / DCP 4
(exact top-k), token for token.

Each model varies several keys at once, and together they cover: shared indexer layers after full ones (two
layers with one latent slot each and one index slot between them), grouped routing (n_group > 1, topk_group <
n_group), norm_topk_prob false, the router bias, two shared experts, a swiglu_limit that clamps, 1 and 3 hyper-
connection streams, index_kpool 1, 2 and 4, a conv kernel of 3, the softplus forget gate (linear_lower_bound
null), a tied head and few index heads. transformers' indexer is pinned to qual's tie-break (lowest pool id
first: glm5_checkpoints.lowest_pool_wins_ties), because with one or two index heads exact-zero scores tie often.
"""

from __future__ import annotations

import json

import pytest
import torch

from glm5_checkpoints import make_glm5, oracle, oracle_greedy, single_thread, tiny_text  # noqa: F401
import qual.cli.generate  # noqa: F401  (registers `qual generate` on the app)
from qual.cli.main import run_app

pytestmark = pytest.mark.slow  # engine processes: scheduled first (tests/conftest.py)

KDA, MLA = "linear_attention", "indexed_attention"
LENGTHS = (5, 41, 13)  # the longest prompt holds more pools than any top-k below selects
MAX_TOKENS = 8

MODELS = {
    "shared-after-full": dict(text=tiny_text(
        num_hidden_layers=6, layer_types=[KDA, MLA, MLA, KDA, MLA, MLA],
        indexer_types=["full", "full", "shared", "full", "full", "shared"],
        mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"])),
    "grouped-router": dict(text=tiny_text(
        layer_types=[KDA, MLA, KDA, MLA], mlp_layer_types=["sparse"] * 4, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=3, norm_topk_prob=False, n_shared_experts=2, swiglu_limit=0.3, index_kpool=2,
        index_topk=6, index_n_heads=2, hc_mult=3)),
    "kpool1-softplus-tied": dict(text=tiny_text(
        layer_types=[MLA, KDA, KDA, MLA], index_kpool=1, index_topk=5, index_n_heads=1, linear_conv_kernel_dim=3,
        linear_lower_bound=None, hc_mult=1), tie=True),
    "kpool4-few-heads": dict(text=tiny_text(index_kpool=4, index_topk=8, index_n_heads=2, hc_mult=3,
                                            linear_conv_kernel_dim=3)),
}
LAYOUTS = [(1, 1), (2, 2), (4, 4)]  # (tp, dcp)


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5matrix")
    return {name: make_glm5(root / name, **kw, seed=i) for i, (name, kw) in enumerate(MODELS.items())}


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": p}) + "\n" for i, p in enumerate(prompts())))
    return path


def qual_generate(target, prompt_file, out, tp, dcp) -> list[list[int]]:
    code = run_app(["generate", "--target", str(target), "--prompts", str(prompt_file), "--tp", str(tp), "--dcp", str(dcp),
                    "--max-tokens", str(MAX_TOKENS), "--dtype", "float64", "--out", str(out)])
    assert code == 0
    return [json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()]


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_equal_transformers_at_every_layout(models, prompt_file, tmp_path, name):
    model = oracle(models[name])
    if name == "grouped-router":  # the bias really steers: a zero bias would leave a path untested
        assert all(float(m.mlp.gate.e_score_correction_bias.abs().min()) > 0
                   for m in model.model.language_model.layers)
    want = [oracle_greedy(model, p, MAX_TOKENS) for p in prompts()]
    for tp, dcp in LAYOUTS:
        got = qual_generate(models[name], prompt_file, tmp_path / f"tp{tp}.jsonl", tp, dcp)
        assert got == want, f"tp {tp} / dcp {dcp}"


# vLLM's forms of the real checkpoint (keys transformers does not know), each recomputed in float64 from its
# definition (glm5_checkpoints.vllm_forms): hyper-connections off; RoPE dims with MLA under NoPE and the indexer
# rotating halves; MLA rotating pairs and the indexer pairs too.
FORMS = {
    "mhc-off": dict(mhc=False, rope_dim=0, mla_rope=False, interleave=False, theta=10000.0),
    "rope-nope-mla": dict(mhc=True, rope_dim=4, mla_rope=False, interleave=False, theta=10000.0),
    "rope-mla-interleaved": dict(mhc=True, rope_dim=4, mla_rope=True, interleave=True, theta=500.0),
}
FORM_TEXT = tiny_text(layer_types=[MLA, KDA, MLA, MLA], indexer_types=["full", "full", "full", "shared"],
                      index_n_heads=4, hc_mult=2)


@pytest.mark.parametrize("name", list(FORMS))
def test_vllm_forms_equal_their_definition_at_every_layout(prompt_file, tmp_path, name):
    from glm5_checkpoints import make_glm5_form, vllm_forms

    form = FORMS[name]
    path, model = make_glm5_form(tmp_path / "ckpt", FORM_TEXT, form, seed=7)
    with vllm_forms(form):
        want = [oracle_greedy(model, p, MAX_TOKENS) for p in prompts()]
    for tp, dcp in LAYOUTS:
        got = qual_generate(path, prompt_file, tmp_path / f"tp{tp}.jsonl", tp, dcp)
        assert got == want, f"tp {tp} / dcp {dcp}"


def engine_tokens(path, device: str, graphs=()):
    """Greedy float32 tokens of the prompts at TP 1 on `device` (decode steps from CUDA graphs of `graphs` sizes)."""
    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import GenerationRequest, LLMEngine

    cfg = EngineConfig(str(path), None, ParallelConfig(1, 1, 1), CacheConfig(block_size=4, memory_bytes=2**26),
                       dtype="float32", device=device, cuda_graph_sizes=tuple(graphs), max_model_len=64)
    with LLMEngine(cfg) as engine:
        out = engine.generate([GenerationRequest(f"r{i}", tuple(p), MAX_TOKENS) for i, p in enumerate(prompts())],
                              SamplingParams(max_tokens=MAX_TOKENS))
        record = engine.graph_capture() if graphs else None
    return [r.output_token_ids for r in out], record


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(MODELS) + list(FORMS))
def test_cuda_eager_and_graph_decoding_give_the_cpus_tokens(models, tmp_path, name):
    """Every configuration of the matrix in float32 at TP 1: CUDA eager, CUDA graphs (decode steps of 3 requests
    replayed at size 4) and the CPU decode the same tokens."""
    if name in FORMS:
        from glm5_checkpoints import make_glm5_form

        path, _ = make_glm5_form(tmp_path / "ckpt", FORM_TEXT, FORMS[name], seed=7)
    else:
        path = models[name]
    cpu, _ = engine_tokens(path, "cpu")
    eager, _ = engine_tokens(path, "cuda")
    graphs, record = engine_tokens(path, "cuda", graphs=(1, 2, 4))
    assert record["status"] == "captured" and sum(record["replays"].values()) > 0, record
    assert eager == cpu and graphs == cpu
