"""GLM-5 weight loading: what save_pretrained writes, both prefixes, clear errors, TP shards."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5_checkpoints import make_glm5, single_thread, tiny_text  # noqa: F401

from qual.errors import QualError
from qual.runtime.models.glm5.weights import load_glm5_weights

PRE = "model.language_model."


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5w")
    return make_glm5(root / "full", tiny_text()), make_glm5(root / "text", tiny_text(), composite=False)


def _edit(src, dst, edit):
    """A copy of checkpoint src whose tensors dict went through edit()."""
    shutil.copytree(src, dst)
    (f,) = dst.glob("*.safetensors")
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))
    return dst


def test_both_prefixes_and_skipped_vision(ckpts, tmp_path):
    full, text = load_glm5_weights(ckpts[0]), load_glm5_weights(ckpts[1])
    assert full.prefix == PRE and full.vision_tensors_skipped > 0 and full.cfg.vision_skipped
    assert full.lm_head is not None and full.lm_head.shape == (97, 32)
    assert text.prefix == "" and text.lm_head is None and text.vision_tensors_skipped == 0
    # a text stack under "model." with its lm_head (a causal-LM style export)
    head = torch.randn(97, 32)
    moved = _edit(ckpts[1], tmp_path / "m", lambda t: t.update({"model." + k: t.pop(k) for k in list(t)} | {"lm_head.weight": head}))
    m = load_glm5_weights(moved)
    assert m.prefix == "model." and torch.equal(m.lm_head, head) and torch.equal(m.embed, text.embed)


def test_missing_wrong_shaped_and_unexpected_tensors_are_named(ckpts, tmp_path):
    expert = PRE + "layers.3.mlp.experts.5.down_proj.weight"
    gone = _edit(ckpts[0], tmp_path / "a", lambda t: t.pop(expert))
    with pytest.raises(QualError, match=f"missing tensor '{expert}'"):
        load_glm5_weights(gone)
    conv = PRE + "layers.1.self_attn.k_conv1d.weight"
    bent = _edit(ckpts[0], tmp_path / "b", lambda t: t.update({conv: torch.zeros(32, 1, 3)}))
    with pytest.raises(QualError, match=rf"tensor '{conv}' has shape \(32, 1, 3\), expected \(32, 1, 4\)"):
        load_glm5_weights(bent)
    bias = PRE + "layers.3.self_attn.q_a_proj.bias"
    extra = _edit(ckpts[0], tmp_path / "c", lambda t: t.update({bias: torch.zeros(24)}))
    with pytest.raises(QualError, match=f"unexpected tensor '{bias}'"):
        load_glm5_weights(extra)
    # MTP layers past num_hidden_layers are not part of the text stack
    mtp = _edit(ckpts[0], tmp_path / "d", lambda t: t.update({PRE + "layers.4.eh_proj.weight": torch.zeros(2, 2)}))
    assert len(load_glm5_weights(mtp).layers) == 4
    headless = _edit(ckpts[0], tmp_path / "e", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(QualError, match="missing tensor 'lm_head.weight'"):
        load_glm5_weights(headless)


def test_tp_shards_split_heads_and_intermediates_and_replicate_the_rest(ckpts):
    one = load_glm5_weights(ckpts[0], dtype=torch.float64)
    two = [load_glm5_weights(ckpts[0], r, 2, dtype=torch.float64) for r in range(2)]
    cat = lambda f, dim=0: torch.cat([f(s) for s in two], dim)  # noqa: E731
    k0, m3 = one.layers[0].kda, one.layers[3]
    HD = 4 * 8
    assert torch.equal(cat(lambda s: s.layers[0].kda.qkv[: HD // 2]), k0.qkv[:HD])  # q rows of both halves
    assert torch.equal(cat(lambda s: s.layers[0].kda.conv[HD // 2: HD]), k0.conv[HD: 2 * HD])  # k channels
    assert torch.equal(cat(lambda s: s.layers[0].kda.a_log), k0.a_log)
    assert torch.equal(cat(lambda s: s.layers[0].kda.o_proj, 1), k0.o_proj)
    assert torch.equal(cat(lambda s: s.layers[3].mla.w_uk), m3.mla.w_uk)
    assert torch.equal(cat(lambda s: s.layers[3].moe.gate, 1), m3.moe.gate)
    assert torch.equal(cat(lambda s: s.layers[3].moe.shared.down, 1), m3.moe.shared.down)
    assert torch.equal(cat(lambda s: s.layers[0].mlp.up), one.layers[0].mlp.up)
    for s in two:  # replicated: the latent path, the indexer, the router, the MHC weights
        assert torch.equal(s.layers[3].mla.kv_a, m3.mla.kv_a) and torch.equal(s.layers[3].mla.q_a, m3.mla.q_a)
        assert torch.equal(s.layers[3].indexer.wq_b, m3.indexer.wq_b)
        assert torch.equal(s.layers[3].moe.router, m3.moe.router)
        assert torch.equal(s.layers[0].kda.f_a, k0.f_a) and torch.equal(s.layers[2].attn_hc.fn, one.layers[2].attn_hc.fn)
    with pytest.raises(QualError, match="linear_num_heads=4 is not divisible by tp=3"):
        load_glm5_weights(ckpts[0], 0, 3)


def test_precision_critical_tensors_stay_float32_in_bf16(ckpts):
    w = load_glm5_weights(ckpts[0], dtype=torch.bfloat16)
    assert w.embed.dtype == torch.bfloat16 and w.layers[0].kda.qkv.dtype == torch.bfloat16
    assert w.layers[0].kda.a_log.dtype == torch.float32 and w.layers[0].kda.conv.dtype == torch.float32
    assert w.layers[3].moe.router.dtype == torch.float32 and w.layers[1].ffn_hc.base.dtype == torch.float32
    assert json.loads((ckpts[0] / "config.json").read_text())["model_type"] == "glm5_next"
