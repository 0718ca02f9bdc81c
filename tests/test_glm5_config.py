"""GLM-5 config.json parsing: transformers' defaults and derivations, the three file forms, refusals by name."""

import json
import re

import pytest

from glm5_checkpoints import TINY_VISION, tiny_text

from qual.errors import QualError
from qual.runtime.models.glm5.config import load_glm5_config, parse_glm5_config

transformers = pytest.importorskip("transformers")

FORMS = {
    "defaults": dict(num_hidden_layers=9),
    "pattern": dict(num_hidden_layers=6, index_topk_pattern="FFSFFS", layer_types=["full_attention"] * 6),
    "freq": dict(num_hidden_layers=6, index_topk_freq=2, index_skip_topk_offset=2, layer_types=["full_attention"] * 6),
    "linear dict": dict(num_hidden_layers=4, linear_attn_config=dict(head_dim=16, num_heads=2, short_conv_kernel_size=3)),
    "safe gate": dict(num_hidden_layers=4, linear_lower_bound=None, linear_attn_config={}),
    "softplus": dict(num_hidden_layers=4, linear_lower_bound=None, linear_attn_config=dict(safe_gate=False)),
    "short": dict(num_hidden_layers=2),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_derived_fields_equal_transformers(form):
    raw = dict(model_type="glm5_next_text", **FORMS[form])
    ours, theirs = parse_glm5_config(raw, "config.json"), transformers.Glm5NextTextConfig(**FORMS[form])
    assert list(ours.layer_types) == theirs.layer_types
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert list(ours.indexer_types) == theirs.indexer_types
    for key in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound", "hidden_size",
                "index_topk", "index_kpool", "hc_mult", "n_routed_experts", "qk_head_dim", "vocab_size"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert not ours.vision_skipped


def test_nested_and_flat_multimodal_forms(tmp_path):
    transformers.Glm5NextConfig(text_config=tiny_text(), vision_config=TINY_VISION).save_pretrained(tmp_path)
    nested = load_glm5_config(tmp_path)
    text_only = parse_glm5_config(dict(model_type="glm5_next_text", **tiny_text()), "x")
    flat_raw = dict(model_type="glm5_next", vision_config=TINY_VISION, image_token_id=5, **tiny_text())
    flat = parse_glm5_config(flat_raw, "flat/config.json")
    assert transformers.Glm5NextConfig(**flat_raw).text_config.hidden_size == flat.hidden_size  # transformers agrees
    for cfg in (nested, flat):
        assert cfg.vision_skipped
        assert cfg.layer_types == text_only.layer_types and cfg.hidden_size == text_only.hidden_size
        assert cfg.index_n_heads == 16 and cfg.swiglu_limit == 1.0
    assert str(tmp_path) in nested.source


REFUSED = {
    "unknown key": (dict(frobnicate=1), "frobnicate"),
    "attention bias": (dict(attention_bias=True), "attention_bias"),
    "activation": (dict(hidden_act="gelu"), "hidden_act"),
    "yarn": (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "rope_parameters"),
    "rope dims without mla_use_nope": (dict(qk_rope_head_dim=4, indexer_rope_interleave=True), "needs mla_use_nope"),
    "rope dims without the indexer's layout": (dict(qk_rope_head_dim=4, mla_use_nope=True), "needs indexer_rope_interleave"),
    "odd rope dims": (dict(qk_rope_head_dim=3, mla_use_nope=True, indexer_rope_interleave=False), "even number"),
    "MLA RoPE without a theta": (dict(qk_rope_head_dim=4, mla_use_nope=False, indexer_rope_interleave=False),
                                 "needs rope_theta"),
    "RoPE on nothing": (dict(mla_use_nope=False), "mla_use_nope=false with qk_rope_head_dim=0"),
    "partial RoPE": (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
                     "rope_parameters.partial_rotary_factor"),
    "mhc not a bool": (dict(mhc="yes"), "mhc must be true or false"),
    "gqa": (dict(num_key_value_heads=2), "num_key_value_heads"),
    "topk % kpool": (dict(index_topk=10), "index_topk % index_kpool"),
    "kimi keys": (dict(linear_attn_config=dict(kda_layers=[1, 2])), "linear_attn_config.kda_layers"),
    "no tail": (dict(index_kpool_always_select_tail=False), "index_kpool_always_select_tail"),
    "quantized, another method": (dict(quantization_config=dict(quant_method="gptq", bits=4)),
                                  "quantization_config.quant_method 'gptq' is not implemented"),
    "quantized, per-tensor": (dict(quantization_config=dict(quant_method="fp8")), "per-tensor FP8 scales"),
    "layer type": (dict(layer_types=["linear_attention", "sliding_attention"] * 2), "sliding_attention"),
    "groups": (dict(n_group=3), "n_group"),
    "first shared": (dict(indexer_types=["full", "full", "full", "shared"]), "indexer_types[3]='shared' follows a linear"),
    "shared after KDA": (dict(layer_types=["indexed_attention", "linear_attention"] * 2,
                              indexer_types=["full", "full", "shared", "full"]), "indexer_types[2]='shared' follows a linear"),
    "shared chain": (dict(layer_types=["linear_attention"] + ["indexed_attention"] * 3,
                          indexer_types=["full", "full", "shared", "shared"]), "indexer_types[3]='shared' follows a shared"),
    "shared first": (dict(layer_types=["indexed_attention"] * 4, indexer_types=["shared"] + ["full"] * 3),
                     "indexer_types[0]='shared' follows nothing"),
    "router": (dict(scoring_func="softmax"), "scoring_func"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unimplemented_keys_are_refused_by_name(tmp_path, case):
    over, name = REFUSED[case]
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="glm5_next_text", **tiny_text(**over))))
    with pytest.raises(QualError, match=re.escape(name)) as err:
        load_glm5_config(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


@pytest.mark.parametrize("case", ["first shared", "shared after KDA", "shared chain", "shared first"])
def test_transformers_refuses_the_shared_layouts_we_refuse(case):
    """The shared-indexer layouts refused above are the ones transformers' forward cannot run."""
    import torch

    model = transformers.Glm5NextTextModel(transformers.Glm5NextTextConfig(**tiny_text(**REFUSED[case][0])))
    with pytest.raises(ValueError, match="Shared DSA layers require top-k indices"), torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]))


def test_inert_keys_are_accepted():
    raw = dict(model_type="glm5_next_text", rope_parameters=dict(rope_type="default", rope_theta=1e4),
               output_router_logits=True, num_nextn_predict_layers=1, router_aux_loss_coef=0.1, head_dim=99,
               architectures=["Glm5NextTextModel"], dtype="bfloat16", **tiny_text())
    assert parse_glm5_config(raw, "x").qk_head_dim == 8


def test_the_real_checkpoints_forms():
    """vLLM's keys: RoPE dims with MLA under NoPE (the indexer still rotates, with vLLM's default theta when none is
    given), MLA RoPE with a theta, hyper-connections off; the indexer's layout flag is inert without RoPE dims."""
    parse = lambda **over: parse_glm5_config(dict(model_type="glm5_next_text", **tiny_text(**over)), "x")  # noqa: E731
    nope = parse(qk_rope_head_dim=4, mla_use_nope=True, indexer_rope_interleave=False)
    assert (nope.mla_rope, nope.mla_rope_dim, nope.qk_head_dim, nope.rope_theta) == (False, 0, 12, 10000.0)
    rope = parse(qk_rope_head_dim=4, mla_use_nope=False, indexer_rope_interleave=True,
                 rope_parameters=dict(rope_type="default", rope_theta=500.0))
    assert (rope.mla_rope, rope.mla_rope_dim, rope.indexer_rope_interleave, rope.rope_theta) == (True, 4, True, 500.0)
    assert not parse(mhc=False).mhc and parse().mhc
    assert parse(indexer_rope_interleave=True, mla_use_nope=True).mla_rope_dim == 0


def test_file_errors(tmp_path):
    with pytest.raises(QualError, match="no config.json"):
        load_glm5_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(QualError, match="invalid JSON"):
        load_glm5_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="qwen3")))
    with pytest.raises(QualError, match="model_type"):
        load_glm5_config(tmp_path)
    nested = dict(model_type="glm5_next", text_config=tiny_text(), audio_config={})
    with pytest.raises(QualError, match="top-level key 'audio_config'"):
        parse_glm5_config(nested, "x")
