"""Memory of a GLM-5.3-Flash deployment per rank (qual/runtime/models/glm5/sizing.py): the loader's bytes over shapes
equal what it loads from a real checkpoint, and the real model's numbers equal a count by hand."""

import pytest
import torch

from glm5_checkpoints import make_glm5, single_thread, tiny_text  # noqa: F401
from qual.runtime.models.glm5.config import load_glm5_config, parse_glm5_config
from qual.runtime.models.glm5.sizing import cache_bytes, tensor_bytes, weight_bytes
from qual.runtime.models.glm5.weights import load_glm5_weights

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
GiB = 1 << 30


@pytest.mark.parametrize("tp,dtype,tie", [(1, torch.float32, False), (2, torch.bfloat16, True), (4, torch.float64, False)])
def test_sized_weights_are_the_loaded_weights(tmp_path, tp, dtype, tie):
    path = make_glm5(tmp_path / "m", tiny_text(), tie=tie)
    sized = weight_bytes(load_glm5_config(path), tp, dtype)
    for rank in range(tp):
        assert tensor_bytes(load_glm5_weights(path, rank, tp, dtype)) == sized["total"]
    assert sized["lm_head"] == (0 if tie else 97 * 32 * dtype.itemsize)


def test_the_real_model_at_tp4_dcp4_counted_by_hand():
    """transformers' Glm5NextTextConfig defaults with FP8 128 x 128 blocks, TP 4 / DCP 4, bfloat16, K = 15, 32
    sequences of 32k tokens, blocks of 16: 45 layers (KDA where idx % 4 != 3: 34; MLA + DSA: 11), MoE from layer 3
    (42 layers of 288 experts, intermediate 2048 / 4 = 512 a rank)."""
    cfg = parse_glm5_config({"model_type": "glm5_next_text", "quantization_config": FP8}, "real")
    w = weight_bytes(cfg, 4, torch.bfloat16)
    experts = 42 * 3 * 288 * 4096 * 512  # one byte a weight
    scales = 42 * 288 * (2 * (512 // 128) * (4096 // 128) + (4096 // 128) * (512 // 128)) * 4
    assert w["routed experts"] == experts + scales
    assert w["embedding"] == w["lm_head"] == 154880 * 4096 * 2
    assert w["shared experts"] == 42 * 3 * 4096 * 512 * 2 and w["dense MLP"] == 3 * 3 * 4096 * (12288 // 4) * 2
    c = cache_bytes(cfg, tp=4, dcp=4, dtype=torch.bfloat16, num_speculative_tokens=15, context=32768, sequences=32,
                    block_size=16)
    assert c["latent"] == 32 * 11 * (32768 // 4) * 512 * 2  # a quarter of each sequence's latents a rank
    assert c["index"] == 32 * 11 * (32768 // 16 // 4) * 128 * 2  # a quarter of its pools
    assert c["index_tail"] == 32 * 11 * 32 * 2 * 128 * 2  # ring of 16 * next_pow2(ceil(31 / 16)) = 32 slots
    heads, conv = 64 // 4, 3 * 64 // 4 * 128
    assert c["kda"] == 32 * 34 * 16 * (conv * 3 * 2 + heads * 128 * 128 * 4)  # K + 1 states a request
    assert w["total"] < 78 * GiB and w["total"] + c["total"] < 100 * GiB  # fits a 141 GiB H200 with room
    plain = weight_bytes(parse_glm5_config({"model_type": "glm5_next_text"}, "real"), 4, torch.bfloat16)
    assert plain["routed experts"] == 2 * experts and plain["total"] > 141 * GiB  # bfloat16 experts do not fit
