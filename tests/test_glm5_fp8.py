"""FP8 block-quantized GLM-5.3-Flash checkpoints (qual/checkpoints/fp8.py): a tiny checkpoint quantized here from a
float model, FP8 where vLLM 0.32 loads FP8 (the MLPs, the experts, the indexer's wq_b; MLA's projections and the
indexer's wk, which vLLM dequantizes on load), decodes exactly as its dequantized twin saved as a plain checkpoint, in
float32 and float64, at TP 1 and at TP 2 / DCP 2 (numerics exact); the routed experts stay FP8 in memory; other
quantization methods, and FP8 tensors vLLM cannot load, are refused by name (exit 2)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import qual.cli.generate  # noqa: F401  (registers `qual generate` on the app)
from glm5_checkpoints import make_glm5, single_thread, tiny_text  # noqa: F401
from qual.checkpoints.fp8 import SCALE_SUFFIX, dequantize, quantize
from qual.cli.main import run_app
from qual.runtime.models.glm5.config import load_glm5_config
from qual.runtime.models.glm5.moe import Fp8Experts
from qual.runtime.models.glm5.sizing import tensor_bytes, weight_bytes
from qual.runtime.models.glm5.fp8_weights import fp8_load_path
from qual.runtime.models.glm5.weights import load_glm5_weights

pytestmark = pytest.mark.slow  # engine processes: scheduled first (tests/conftest.py)

KDA, MLA = "linear_attention", "indexed_attention"
BLOCK = [4, 8]  # divides every quantized dimension here, and each TP 2 rank's MLP and expert slices (8 and 24 rows)


def _quantized(name: str) -> bool:
    """What a GLM FP8 checkpoint may store FP8 for vLLM: what it keeps FP8 and what it dequantizes on load (KDA's
    projections, kv_b_proj, the embeddings, lm_head, norms, router and MHC weights stay as they are)."""
    return fp8_load_path(name) is not None and ".visual." not in name


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(FP8 checkpoint, its dequantized twin): the same model, one stored as float8 + block scales, the other as the
    exact products in float64 (e4m3 x float32 fits a double)."""
    root = tmp_path_factory.mktemp("glm5fp8")
    base = make_glm5(root / "float", tiny_text(layer_types=[KDA, MLA, KDA, MLA], mlp_layer_types=["dense", "sparse",
                                                                                              "sparse", "sparse"]))
    fp8, twin = root / "fp8", root / "twin"
    for d in (fp8, twin):
        shutil.copytree(base, d)
    weights = load_file(str(base / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, w in weights.items():
        if _quantized(name) and w.dim() == 2:
            q, s = quantize(w, tuple(BLOCK))
            quantized[name], quantized[name + SCALE_SUFFIX] = q, s
            dequantized[name] = dequantize(q, s, tuple(BLOCK), torch.float64)
        else:
            quantized[name] = dequantized[name] = w
    assert sum(n.endswith(SCALE_SUFFIX) for n in quantized) > 20
    save_file(quantized, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(twin / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": BLOCK, "modules_to_not_convert": ["lm_head"]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    return fp8, twin


def generate(target, prompts_file, out, tp, dcp, dtype):
    code = run_app(["generate", "--target", str(target), "--prompts", str(prompts_file), "--tp", str(tp), "--dcp",
                    str(dcp), "--max-tokens", "8", "--dtype", dtype, "--out", str(out)])
    assert code == 0
    return [json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("fp8prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": torch.randint(1, 96, (n,), generator=g).tolist()})
                            + "\n" for i, n in enumerate((5, 41, 13))))
    return path


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fp8_checkpoint_decodes_as_its_dequantized_twin(pair, prompts_file, tmp_path, dtype):
    fp8, twin = pair
    for tp, dcp in ((1, 1), (2, 2)):
        got = generate(fp8, prompts_file, tmp_path / f"fp8-{tp}.jsonl", tp, dcp, dtype)
        want = generate(twin, prompts_file, tmp_path / f"twin-{tp}.jsonl", tp, dcp, dtype)
        assert got == want, (dtype, tp)


def test_the_routed_experts_stay_fp8_and_the_rest_is_dequantized_on_load(pair):
    fp8, twin = pair
    for rank in range(2):
        q, plain = load_glm5_weights(fp8, rank, 2, torch.float64), load_glm5_weights(twin, rank, 2, torch.float64)
        moe, plain_moe = q.layers[1].moe, plain.layers[1].moe
        assert isinstance(moe.gate, Fp8Experts) and moe.gate.q.dtype == torch.float8_e4m3fn
        assert moe.down.q.shape == (8, 32, 8) and moe.down.scale.shape == (8, 8, 1)  # this rank's 8 of 16 columns
        for e in range(moe.gate.shape[0]):
            for proj in ("gate", "up", "down"):
                assert torch.equal(getattr(moe, proj)[e], getattr(plain_moe, proj)[e])
        assert torch.equal(q.layers[1].mla.q_b, plain.layers[1].mla.q_b)  # dequantized at load, sliced after
        assert torch.equal(q.layers[0].kda.qkv, plain.layers[0].kda.qkv)
        # sizing counts the loader's bytes: FP8 experts at one byte a weight plus their scales
        assert tensor_bytes(q) == weight_bytes(load_glm5_config(fp8), 2, torch.float64)["total"] < tensor_bytes(plain)


def _edit_config(src, dst, **quant):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], **quant}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("quant,message", [
    (dict(quant_method="awq"), "quantization_config.quant_method 'awq' is not implemented"),
    (dict(weight_block_size=None), "per-tensor FP8 scales"),
    (dict(activation_scheme="static"), "activation_scheme 'static'"),
    (dict(weight_block_size=[8, 8]), "'model.language_model.layers.0.self_attn.o_proj.weight_scale_inv' has shape"),
])
def test_other_quantizations_exit_2_with_one_line(pair, prompts_file, tmp_path, capsys, quant, message):
    bad = _edit_config(pair[0], tmp_path / "bad", **quant)
    code = run_app(["generate", "--target", str(bad), "--prompts", str(prompts_file), "--max-tokens", "2",
                    "--out", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def _requantized(pair, tmp_path, block, name="bad", only=""):
    """The twin's floats quantized again with another block, where _quantized says (and the name holds `only`)."""
    bad = _edit_config(pair[0], tmp_path / name, weight_block_size=list(block))
    out = {}
    for n, w in load_file(str(pair[1] / "model.safetensors")).items():
        if _quantized(n) and w.dim() == 2 and only in n:
            out[n], out[n + SCALE_SUFFIX] = quantize(w, block)
        else:
            out[n] = w
    save_file(out, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad


def test_slices_off_the_scale_blocks_are_refused_as_vllm_refuses_them(pair, tmp_path):
    """vLLM's validate_fp8_block_shape(_moe): 8 x 8 blocks fit an expert's 8 intermediate rows a rank at TP 2, not
    the 4 of TP 4; the dense MLP's 48 rows are 12 a rank at TP 4, half a block and a half; blocks of 32 rows leave
    an expert's 16 rows short of a block at TP 1 too (the merged gate/up GEMM of every TP; only the experts FP8)."""
    from qual.errors import QualError

    bad = _requantized(pair, tmp_path, (8, 8))
    assert load_glm5_weights(bad, 1, 2, torch.float32).layers[1].moe.gate.scale.shape == (8, 1, 4)  # 8 rows: fits
    with pytest.raises(QualError, match="intermediate_size=48 at tp=4 gives 12 FP8 gate_proj rows a rank, not a "
                                        "multiple of the weight_block_size 8"):
        load_glm5_weights(bad, 0, 4, torch.float32)
    tall = _requantized(pair, tmp_path, (32, 8), "tall", only=".experts.")
    with pytest.raises(QualError, match="moe_intermediate_size=16 at tp=1 gives each rank 16 gate_proj and up_proj "
                                        "rows, not a multiple of the FP8 weight_block_size 32"):
        load_glm5_weights(tall, 0, 1, torch.float32)


@pytest.mark.parametrize("tensor", ["layers.0.self_attn.q_proj.weight", "layers.1.self_attn.kv_b_proj.weight",
                                    "layers.1.self_attn.indexer.weights_proj.weight", "embed_tokens.weight"])
def test_fp8_where_vllm_has_no_fp8_load_path_is_refused_by_name(pair, tmp_path, tensor):
    """KDA's projections, kv_b_proj, weights_proj, the embedding: vLLM 0.32 builds them without the FP8 quant config
    and has no dequantizing loader for them either."""
    from qual.errors import QualError

    bad = _edit_config(pair[0], tmp_path / "bad")
    weights = load_file(str(pair[1] / "model.safetensors"))
    name = "model.language_model." + tensor
    weights[name], weights[name + SCALE_SUFFIX] = quantize(weights[name], tuple(BLOCK))
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    assert fp8_load_path(name) is None
    with pytest.raises(QualError, match=f"tensor '{name}' is FP8 .* but vLLM 0.32 has no FP8 load path for it"):
        load_glm5_weights(bad, 0, 1, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_checkpoint_on_cuda_decodes_as_its_twin_and_the_cpu(pair, prompts_file, tmp_path):
    """float32 on one GPU: the FP8 checkpoint (experts dequantized on the device as steps use them) gives its twin's
    tokens, and the CPU's."""
    fp8, twin = pair
    on = lambda target, device: run_app([  # noqa: E731
        "generate", "--target", str(target), "--prompts", str(prompts_file), "--max-tokens", "8", "--dtype", "float32",
        "--device", device, "--out", str(tmp_path / f"{target.name}-{device}.jsonl")])
    assert on(fp8, "cuda") == on(twin, "cuda") == on(fp8, "cpu") == 0
    tokens = {name: (tmp_path / name).read_text() for name in ("fp8-cuda.jsonl", "twin-cuda.jsonl", "fp8-cpu.jsonl")}
    assert len(set(tokens.values())) == 1, tokens
