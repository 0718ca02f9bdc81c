"""glm-toy-vllm (qual/data/models/glm-toy-vllm) as vLLM 0.32 requires it, and as far as vLLM's CPU build constructs it.

In .venv-vllm (a subprocess; skipped without it): transformers' config classes there load the toy; every attribute
vLLM's glm5next model code reads from the text config (found by parsing its source) is there; the toy meets the
asserts glm5next makes (index_head_dim 128, index_kpool > 1, the tail always selected, heads split at TP 4); vLLM's
Fp8Config reads its quantization_config; vLLM's KDA state shape calculator sizes a state as the memory plan does.
Then vLLM's ModelConfig stops: inspecting the architecture imports vllm/models/glm5next, whose glm4_1v import needs
torchvision, which `make vllm-venv` uninstalls (its PyPI build breaks transformers beside CPU torch) - nothing of
glm5next's model classes is constructed on this CPU build, and its DSA indexer and MLA kernels are GPU kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from qual.runtime.models.glm5.config import load_glm5_config, parse_glm5_config
from qual.runtime.models.glm5.memory import Deployment, memory_plan, vllm_kda_state_bytes
from qual.runtime.models.glm5.fp8_weights import FP8_KEPT, fp8_load_path

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "qual" / "data" / "models" / "glm-toy-vllm"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SITE = sorted((REPO / ".venv-vllm" / "lib").glob("python3*/site-packages/vllm"))
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
GiB = 1 << 30

VLLM_SIDE = textwrap.dedent('''
    import ast, json, sys, traceback
    import torch
    from transformers import AutoConfig

    toy, site, out = sys.argv[1], sys.argv[2], {}
    config = AutoConfig.from_pretrained(toy)
    text = config.text_config
    # what glm5next reads from the HF config, and what it reads only behind hasattr / getattr defaults
    receivers = {"config", "self.config", "hf_config", "hf_text_config", "self.config.text_config"}
    reads, guarded = set(), set()
    for f in ("common/model.py", "common/attention.py", "common/kda.py"):
        tree = ast.parse(open(site + "/models/glm5next/" + f).read())
        for fn in ast.walk(tree):  # its local `config` is the encoder's CUDA-graph config, not the model's
            if isinstance(fn, ast.FunctionDef) and fn.name == "get_encoder_cudagraph_config":
                fn.body = []
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and ast.unparse(n.value) in receivers:
                reads.add(n.attr)
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr")
                    and ast.unparse(n.args[0]) in receivers):
                guarded.add(n.args[1].value)
    out["missing"] = sorted(a for a in reads - guarded if not hasattr(text, a) and not hasattr(config, a))
    out["reads"] = sorted(reads)
    out["text"] = {k: getattr(text, k, None) for k in ("index_head_dim", "index_kpool", "index_kpool_always_select_tail",
                                                       "num_attention_heads", "linear_num_heads", "mhc", "mla_use_nope")}
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    fp8 = Fp8Config.from_config(config.quantization_config)
    out["fp8"] = [fp8.weight_block_size, fp8.activation_scheme]
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    out["kda_state"] = {}
    for tp, spec in ((1, 7), (4, 7), (4, 15)):
        shapes = MambaStateShapeCalculator.kda_state_shape(tp, text.linear_num_heads, text.linear_head_dim,
                                                           conv_kernel_size=text.linear_conv_kernel_dim, num_spec=spec)
        dtypes = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto", "auto")
        out["kda_state"][f"{tp},{spec}"] = sum(torch.tensor(s).prod().item() * torch.tensor([], dtype=d).element_size()
                                               for s, d in zip(shapes, dtypes))
    from vllm.config import ModelConfig
    try:
        ModelConfig(model=toy, tokenizer=toy, dtype="bfloat16", max_model_len=2048)
        out["model_config"] = "constructed"
    except Exception as exc:
        out["model_config"] = "".join(traceback.format_exception(exc))[-4000:]
    json.dump(out, open(sys.argv[3], "w"))
''')


@pytest.fixture(scope="module")
def vllm_side(tmp_path_factory):
    path = tmp_path_factory.mktemp("toyvllm") / "out.json"
    proc = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_SIDE, str(TOY / "target"), str(SITE[0]), str(path)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(path.read_text()) | {"log": proc.stdout + proc.stderr}


needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists() or not SITE, reason=".venv-vllm absent: run `make vllm-venv`")


@needs_vllm
def test_vllms_config_classes_take_the_toy(vllm_side):
    assert vllm_side["missing"] == [], vllm_side["missing"]
    assert {"mhc", "mla_use_nope", "indexer_rope_interleave", "topk_method", "scoring_func"} <= set(vllm_side["reads"])
    t = vllm_side["text"]
    assert t["index_head_dim"] == 128  # Indexer.forward: assert self.head_dim == 128
    assert t["index_kpool"] > 1 and t["index_kpool_always_select_tail"]  # Glm5NextIndexerCache, _validate_supported_config
    assert t["num_attention_heads"] % 4 == 0 and t["linear_num_heads"] % 4 == 0 and t["mhc"] and t["mla_use_nope"]
    assert vllm_side["fp8"] == [[128, 128], "dynamic"]


@needs_vllm
def test_the_cpu_build_stops_at_importing_glm5next(vllm_side):
    """Where vLLM's CPU build stops today: its ModelConfig cannot inspect the architecture. When this fails, the
    build constructs more of the toy: extend the test above to what it reaches."""
    error = vllm_side["model_config"]
    assert "Glm5NextForConditionalGeneration'] failed to be inspected" in error, error
    log = vllm_side["log"]  # the inspecting subprocess's traceback, logged
    assert "glm4_1v" in log and "No module named 'torchvision'" in log, log[-3000:]


@needs_vllm
def test_the_memory_plan_sizes_a_kda_state_as_vllm(vllm_side):
    cfg = load_glm5_config(TOY / "target")
    for key, want in vllm_side["kda_state"].items():
        tp, spec = map(int, key.split(","))
        assert vllm_kda_state_bytes(cfg, tp, torch.bfloat16, spec) == want


def test_the_toy_is_fp8_exactly_where_vllm_loads_fp8():
    from safetensors import safe_open

    cfg = load_glm5_config(TOY / "target")
    assert cfg.quantization.block == (128, 128) and not cfg.mla_rope and cfg.mhc and cfg.index_head_dim == 128
    with safe_open(str(TOY / "target" / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if ".visual." not in n]
        for name in names:
            kept = fp8_load_path(name) == FP8_KEPT
            is_fp8 = f.get_slice(name).get_dtype() == "F8_E4M3"
            if name.endswith("_scale_inv"):
                continue
            assert is_fp8 == kept and (name + "_scale_inv" in names) == kept, name
    # whole 128-row blocks a rank at TP 4 (vLLM refuses FP8 MLPs and experts that split blocks)
    assert cfg.intermediate_size // 4 % 128 == 0 and cfg.moe_intermediate_size // 4 % 128 == 0


def test_vllms_memory_plan_of_the_real_model_counted_by_hand():
    """transformers' defaults with FP8 128 x 128 blocks at TP 4 / DCP 4, bfloat16, K = 15, 32 sequences of 32k: the
    differences from qual's plan, each by hand."""
    cfg = parse_glm5_config({"model_type": "glm5_next_text", "quantization_config": FP8}, "real")
    d = Deployment(tp=4, dcp=4, num_speculative_tokens=15, context=32768, sequences=32)
    qual, vllm = memory_plan(cfg, d, "qual"), memory_plan(cfg, d, "vllm")
    assert vllm.weights["embedding + lm_head"] == 2 * 154880 // 4 * 4096 * 2  # split by vocabulary
    assert qual.weights["embedding + lm_head"] == 2 * 154880 * 4096 * 2  # replicated
    dense = 3 * (3 * 3072 * 4096 + 3 * 24 * 32 * 4)  # 3 layers x (gate, up, down) of 3072 x 4096 FP8, 24 x 32 scales
    shared = 42 * (3 * 512 * 4096 + 3 * 4 * 32 * 4)
    assert vllm.weights["dense MLP + shared experts + router"] == dense + shared + 42 * (288 * 4096 * 2 + 288 * 4)
    assert vllm.weights["routed experts"] == qual.weights["routed experts"]
    heads, conv = 64 // 4, 3 * 64 // 4 * 128
    state = conv * (3 + 15) * 2 + heads * 128 * 128 * 4  # conv state K - 1 + num_spec wide
    assert state == 1_269_760
    block = 1280  # 128 * ceil(state / (128 * 1024)): the MLA block whose bfloat16 page holds a state
    assert vllm.caches["kda"] == 32 * 34 * 16 * block * 1024  # 1 + K blocks a request, each padded to the MLA page
    assert vllm.caches["latent"] == 32 * 11 * 7 * block * 1024  # 8192 tokens a rank in blocks of 1280
    assert vllm.caches["index"] == 32 * 11 * (32768 // 16 // 4) * 132  # FP8: 128 values and a float32 scale
    # 32 sequences of the listed differences alone (no page padding): 20.59 GiB of KDA state
    assert round(32 * 34 * 16 * state / GiB, 2) == 20.59
    assert round(vllm.weight_bytes / GiB, 2) == 75.11 and round(qual.weight_bytes / GiB, 2) == 77.39
    assert vllm.fits(141 * GiB) and not vllm.fits(80 * GiB)


def test_the_shipped_pair_is_what_its_manifest_says():
    from qual.toy.manifest import verify_manifest

    assert verify_manifest(TOY) == []
    manifest = json.loads((TOY / "MANIFEST.json").read_text())
    assert manifest["command"] == "make glm-toy-vllm" and manifest["total_bytes"] <= 10 * 1024 * 1024
    assert manifest["hyperparameters"]["target_init"] == "qual/data/models/glm-toy/target"
    assert manifest["eval"]["mismatches_vs_greedy"] == 0 and manifest["eval"]["acceptance_rate"] >= 0.2


def test_a_grown_target_computes_what_it_grew_from(tmp_path):
    """qual/toy/grow.py on a tiny random GLM-5 (float32, transformers: its experts' grouped GEMM takes no float64):
    wider MLPs, q_lora and kv_lora ranks and an index head dim twice as wide give the same logits, up to float32
    rounding and the normalisations' eps."""
    from safetensors.torch import load_file, save_file
    from transformers import Glm5NextForConditionalGeneration

    from glm5_checkpoints import make_glm5, tiny_text
    from qual.toy.grow import grow_glm_state

    old = tiny_text(index_kpool=2, index_topk=4)
    new = dict(old, intermediate_size=64, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=48, index_head_dim=16)
    src = make_glm5(tmp_path / "old", old)
    dst = make_glm5(tmp_path / "new", new)  # its config and vision tower; its text weights replaced below
    grown = grow_glm_state(load_file(str(src / "model.safetensors")), old, new)
    save_file(grown, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [Glm5NextForConditionalGeneration.from_pretrained(p, dtype=torch.float32)(input_ids=ids).logits
                  for p in (src, dst)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
