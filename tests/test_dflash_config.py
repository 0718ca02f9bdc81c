"""The drafter format module (qual/checkpoints/dflash.py): refusals by name, DFlash2's fields written and read back,
unexpected tensors named, and the shipped toy drafter read as trained."""

import json
import shutil

import pytest

from checkpoints import make_draft, tiny_config
from qual.checkpoints import dflash as fmt
from qual.checkpoints.config import read_config
from qual.errors import QualError
from qual.paths import DATA_DIR

PROBE = "__qual_probe__"  # a value no refused key may carry


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return make_draft(tmp_path_factory.mktemp("cfg") / "draft")


def _parse(cfg, path):
    return fmt.DFlashConfig.from_json(cfg, path)


@pytest.mark.parametrize("key", sorted(fmt.REFUSED))
def test_refused_top_level_keys_are_named(draft, key):
    cfg = read_config(draft)
    with pytest.raises(QualError, match=f"{key} is not supported"):
        _parse({**cfg, key: PROBE}, draft)
    _parse({**cfg, key: None}, draft)  # present but empty: nothing to honour


def test_unknown_keys_are_refused_by_name(draft):
    cfg = read_config(draft)
    with pytest.raises(QualError, match="unknown key glide_path"):
        _parse({**cfg, "glide_path": 1}, draft)
    with pytest.raises(QualError, match="unknown key dflash_config.markov_rank"):
        _parse({**cfg, "dflash_config": {**cfg["dflash_config"], "markov_rank": 4}}, draft)


@pytest.mark.parametrize("key,value,message", [
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("draft_vocab_size", 32, "draft_vocab_size 32 differs"),
    ("target_hidden_size", 128, "target_hidden_size 128 differs"),
    ("logit_scale", -1.0, "logit_scale -1.0 is not supported"),
    ("use_aux_hidden_state", False, "use_aux_hidden_state False is not supported"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "rope_parameters.rope_type 'yarn' is not supported"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling.rope_type 'linear' is not supported"),
    ("rope_parameters", {"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("is_causal", "yes", "is_causal: expected true or false, got .yes."),
    ("model_type", "llama", "model_type must be 'qwen3'"),
])
def test_values_the_runtime_does_not_implement_are_refused_by_key(draft, key, value, message):
    with pytest.raises(QualError, match=message):
        _parse({**read_config(draft), key: value}, draft)


FLAGS = [("", k) for k in ("is_causal", "is_neox_style", "use_sliding_window", "add_swa_attention_sink_bias",
                             "has_own_lm_head")] + [("dflash_config.", k) for k in ("causal", "use_swa",
                                                                                     "attention_sink_bias")]


@pytest.mark.parametrize("prefix,key", FLAGS)
@pytest.mark.parametrize("value", ["false", 1, 0, "yes"])
def test_every_flag_is_read_as_written_and_refused_in_one_wording(draft, prefix, key, value):
    """Each true/false key of the drafter's config.json, at the top or in dflash_config, refuses what is not a JSON
    boolean in the words the Qwen3 target reader uses too (qual.checkpoints.config.true_or_false)."""
    cfg = read_config(draft)
    changed = {**cfg, key: value} if not prefix else {**cfg, "dflash_config": {**cfg["dflash_config"], key: value}}
    with pytest.raises(QualError) as err:
        _parse(changed, draft)
    assert str(err.value) == f"{draft / 'config.json'}: {prefix}{key}: expected true or false, got {value!r}"


@pytest.mark.parametrize("key,value,message", [
    ("sample_from_anchor", True, "sample_from_anchor must be false"),
    ("use_aux_hidden_state", False, "dflash_config.use_aux_hidden_state False"),
    ("conv_kernel_size", 3, "conv_kernel_size is a DFlash2 key"),
    ("output_multiplier", 2.0, "output_multiplier is a DFlash2 key"),
])
def test_dflash_config_values_are_refused_by_key(draft, key, value, message):
    cfg = read_config(draft)
    with pytest.raises(QualError, match=message):
        _parse({**cfg, "dflash_config": {**cfg["dflash_config"], key: value}}, draft)


def test_dflash2_fields_round_trip_and_are_checked(tmp_path):
    p = fmt.DFlash2Params(3, 16, 8, 4, input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=30.0)
    path = make_draft(tmp_path / "d2", layer_types=("sliding_attention", "full_attention"), sliding_window=5,
                      options={"dflash2": p, "causal": True, "is_neox_style": False, "value_scale": 0.7,
                               "attention_sink": True}, attention_bias=True)
    raw = read_config(path)
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["use_sliding_window"] is True
    back = fmt.read_dflash(path)
    assert back.dflash2 == p and back.layer_causal(1) and back.layer_window(0) == 5 and back.layer_window(1) is None
    assert (back.is_neox_style, back.value_scale, back.attention_sink, back.layers.attention_bias) == (False, 0.7, True, True)
    d = raw["dflash_config"]
    for key, value, message in [("conv_group_size", 24, "must divide hidden_size=64"),
                                ("selector_top_k", 0, "positive integer"), ("output_multiplier", 0.0, "positive"),
                                ("selector_rank", None, "positive integer")]:
        with pytest.raises(QualError, match=message):
            _parse({**raw, "dflash_config": {**d, key: value}}, path)
    without = {k: v for k, v in d.items() if k != "selector_rank"}
    with pytest.raises(QualError, match="needs dflash_config.selector_rank"):
        _parse({**raw, "dflash_config": without}, path)
    # vLLM treats a cap <= 0 as none
    assert _parse({**raw, "dflash_config": {**d, "final_logit_softcapping": -1.0}}, path).dflash2.final_logit_softcapping is None


def test_unexpected_and_refused_tensors_are_named(tmp_path, draft):
    import torch
    from safetensors.torch import load_file, save_file

    from qual.runtime.engine import LLMEngine
    from qual.runtime.config import EngineConfig
    from checkpoints import make_target

    target = make_target(tmp_path / "t")
    for name, message in [("d2t", "tensor 'd2t' is not supported: a draft-to-target"),
                          ("layers.0.attention_conv.base_kernel", "unexpected tensor 'layers.0.attention_conv.base_kernel'")]:
        d = tmp_path / name
        shutil.copytree(draft, d)
        w = load_file(str(d / "model.safetensors"))
        w[name] = torch.zeros(3)
        save_file(w, str(d / "model.safetensors"))
        with pytest.raises(QualError, match=message):
            LLMEngine(EngineConfig(str(target), str(d)))


def test_the_toy_drafter_reads_as_trained():
    """Its config sets rope_theta (10000) and nothing this format refuses; the runtime's RoPE base is unchanged."""
    path = DATA_DIR / "models" / "toy" / "draft"
    raw = json.loads((path / "config.json").read_text())
    cfg = fmt.read_dflash(path)
    assert raw["rope_theta"] == cfg.layers.rope_theta == 10000.0
    assert cfg.architecture == "DFlashDraftModel" and cfg.sliding_window is None
    assert [cfg.layer_causal(i) for i in range(2)] == [False, False]
    assert cfg.layers == fmt.DFlashConfig.from_json(cfg.to_json(), path).layers
    assert tiny_config().head_dim == 16  # the tests' checkpoints state head_dim (absent: transformers' 128)
