"""Bad configurations and checkpoints fail before any process starts, naming the constraint."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from checkpoints import make_draft, make_target
from qual.errors import QualError
from qual.runtime.backends import parse_backend
from qual.runtime.config import HANG_DUMP_ENV, CacheConfig, EngineConfig, ParallelConfig, hang_dump_seconds
from qual.runtime.engine import validate


def cfg(target, draft=None, tp=1, dcp=1, interleave=1, block_size=4):
    return EngineConfig(str(target), str(draft) if draft else None, ParallelConfig(tp, dcp, interleave), CacheConfig(block_size=block_size))


def test_dcp_must_divide_tp():
    with pytest.raises(QualError, match="tp % dcp"):
        ParallelConfig(tp=4, dcp=3)


def test_dcp_bounded_by_kv_head_replication(tmp_path):
    gqa = make_target(tmp_path / "gqa", num_key_value_heads=2)
    validate(cfg(gqa, tp=4, dcp=2))  # 4 // 2 = 2: fine
    with pytest.raises(QualError, match=r"dcp <= tp // num_kv_heads"):
        validate(cfg(gqa, tp=4, dcp=4))


def test_backends_are_chosen_by_name_and_refused_where_they_cannot_run():
    EngineConfig("x", backend="compiled")  # torch.compile runs on the CPU too
    EngineConfig("x", device="cuda", dtype="bfloat16", backend="compiled-autotune+triton-gemm+triton-attention")
    with pytest.raises(QualError, match="backend 'reduce-overhead': expected 'pytorch' or parts"):
        EngineConfig("x", backend="reduce-overhead")  # inductor's own CUDA graphs inside ours: not a part
    assert parse_backend("reference") == parse_backend("pytorch") == parse_backend(EngineConfig("x").backend)
    with pytest.raises(QualError, match="at most one of compiled"):
        EngineConfig("x", backend="compiled+compiled-autotune")
    with pytest.raises(QualError, match="triton-gemm need device cuda"):
        EngineConfig("x", backend="triton-gemm")
    with pytest.raises(QualError, match="triton-gemm need dtype bfloat16 or float16"):
        EngineConfig("x", device="cuda", dtype="float32", backend="triton-gemm")
    with pytest.raises(QualError, match="triton-attention need device cuda"):
        EngineConfig("x", backend="triton-attention")


def test_fused_backend_needs_one_gpu_rank():
    EngineConfig("x", device="cuda", dtype="float32", backend="fused")
    EngineConfig("x", device="cuda", dtype="bfloat16", backend="compiled+fused")  # the step around the kernel compiled
    with pytest.raises(QualError, match="fused need device cuda"):
        EngineConfig("x", backend="fused")
    with pytest.raises(QualError, match="fused needs dtype bfloat16, float16 or float32"):
        EngineConfig("x", device="cuda", dtype="float64", backend="fused")
    with pytest.raises(QualError, match="fused needs tp 1"):
        EngineConfig("x", device="cuda", dtype="bfloat16", parallel=ParallelConfig(2, 1, 1), backend="compiled+fused")


@pytest.mark.parametrize("part", ["fused-layer", "gluon-layer"])
def test_layer_parts_need_half_precision_on_one_gpu_rank(part):
    EngineConfig("x", device="cuda", dtype="bfloat16", backend=f"compiled+{part}+triton-attention+pdl")
    EngineConfig("x", device="cuda", dtype="float16", backend=f"{part}+pdl")  # pdl launches its products
    with pytest.raises(QualError, match=f"{part} need device cuda"):
        EngineConfig("x", backend=part)
    with pytest.raises(QualError, match=f"{part} need dtype bfloat16 or float16"):
        EngineConfig("x", device="cuda", dtype="float32", backend=part)
    with pytest.raises(QualError, match=f"{part} needs tp 1"):
        EngineConfig("x", device="cuda", dtype="bfloat16", parallel=ParallelConfig(2, 1, 1), backend=part)
    assert part in parse_backend(f"{part}+pdl").record()["serves"]
    with pytest.raises(QualError, match="at most one of fused-layer, gluon-layer"):
        parse_backend("fused-layer+gluon-layer")


def test_gluon_layer_is_refused_by_name_on_a_gpu_or_triton_it_cannot_run(monkeypatch):
    """check_device, once the GPU is known: before compute capability 9.0 (TMA, warpgroup MMA), and a Triton without
    the Gluon the kernels are written in. The GPU's answers are patched: this machine may have none."""
    import torch

    from qual.runtime.backends import gluon_gemm

    backend = parse_backend("gluon-layer+triton-attention")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "an A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(QualError, match=r"gluon-layer need a GPU of compute capability 9.0 or later \(got an A100\)"):
        backend.check_device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(gluon_gemm, "available", lambda: False)
    with pytest.raises(QualError, match=r"gluon-layer needs Triton 3\.6\.x with Gluon"):
        backend.check_device("cuda")
    monkeypatch.setattr(gluon_gemm, "available", lambda: True)
    backend.check_device("cuda")  # nothing else is asked of the GPU without pdl


def test_gluon_layer_refuses_shapes_its_tma_tiles_cannot_take():
    """A head is one column block of the qkv product (64 or 128 wide), and TMA reads rows of 16-byte multiples: every
    other Qwen3 shape is refused by name where the target builds its products."""
    from qual.runtime.backends import gluon_gemm
    from qual.runtime.backends.gluon_layer_products import GluonLayerProducts, shape_problem

    assert shape_problem(4096, 14336, 32, 128) is None and shape_problem(64, 128, 4, 64) is None
    assert "head_dim 32 is not one of 64, 128" in shape_problem(64, 128, 4, 32)
    assert "head_dim 256" in shape_problem(4096, 14336, 32, 256)
    assert "hidden_size 1028 is not a multiple of 8" in shape_problem(1028, 3072, 16, 64)
    assert "intermediate_size 3076 is not a multiple of 8" in shape_problem(1024, 3076, 16, 64)
    import torch

    want = "head_dim 32" if gluon_gemm.available() else r"needs Triton 3\.6\.x with Gluon"
    with pytest.raises(QualError, match=f"backend part gluon-layer.*{want}"):
        GluonLayerProducts(64, 128, 4, 1, 32, 1e-6, torch.device("cpu"))


def test_pdl_backend_launches_some_triton_kernels_on_a_gpu():
    EngineConfig("x", device="cuda", dtype="bfloat16", backend="compiled+triton-gemm+triton-attention+pdl")
    EngineConfig("x", device="cuda", dtype="float32", backend="compiled+pdl")  # inductor's kernels alone
    with pytest.raises(QualError, match="pdl need device cuda"):
        EngineConfig("x", backend="compiled+pdl")
    with pytest.raises(QualError, match="name at least one of them"):
        EngineConfig("x", device="cuda", dtype="bfloat16", backend="pdl")
    assert parse_backend("compiled+pdl").pdl and not parse_backend("compiled").pdl


def test_a_bad_hang_dump_interval_is_refused_before_any_process_starts(tmp_path):
    assert hang_dump_seconds({}) is None and hang_dump_seconds({HANG_DUMP_ENV: ""}) is None
    assert hang_dump_seconds({HANG_DUMP_ENV: "0.2"}) == 0.2
    for bad in ("abc", "0", "-1", "nan", "1e300"):  # 1e300: beyond what faulthandler's timer holds
        with pytest.raises(QualError, match=f"^{HANG_DUMP_ENV}='{re.escape(bad)}': expected a number of seconds > 0"):
            hang_dump_seconds({HANG_DUMP_ENV: bad})
    # was a rank's traceback and exit 3 ("engine failure") once both arms' ranks had started
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    proc = subprocess.run([sys.executable, "-m", "qual", "run", "--dcp", "2", "--limit", "2", "--out", out,
                           "--history", db], capture_output=True, text=True, timeout=300,
                          env={**os.environ, HANG_DUMP_ENV: "abc"})
    assert (proc.returncode, proc.stderr) == \
        (2, f"error: {HANG_DUMP_ENV}='abc': expected a number of seconds > 0 and at most 86400, or unset (off)\n")
    assert not out.exists() and not db.exists()
    dry = subprocess.run([sys.executable, "-m", "qual", "run", "--dcp", "2", "--dry-run"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, HANG_DUMP_ENV: "abc"})
    assert (dry.returncode, dry.stderr) == (proc.returncode, proc.stderr)  # the dry run approved it before


def test_interleave_must_divide_block_size():
    with pytest.raises(QualError, match="block_size % interleave"):
        cfg("x", tp=2, dcp=2, interleave=3, block_size=4)
    with pytest.raises(QualError, match="block_size >= interleave"):
        cfg("x", tp=2, dcp=2, interleave=8, block_size=4)


def test_heads_must_split_across_tp(tiny_pair):
    with pytest.raises(QualError, match="num_attention_heads=4 is not divisible by tp=3"):
        validate(cfg(tiny_pair[0], tp=3, dcp=1))


def test_missing_and_malformed_checkpoints(tmp_path, tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(QualError, match="checkpoint directory not found"):
        validate(cfg(tmp_path / "nope"))
    bad = tmp_path / "bad"
    shutil.copytree(target, bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(QualError, match="invalid JSON"):
        validate(cfg(bad))
    (bad / "config.json").unlink()
    with pytest.raises(QualError, match="no config.json"):
        validate(cfg(bad))
    noweights = tmp_path / "noweights"
    shutil.copytree(target, noweights)
    (noweights / "model.safetensors").unlink()
    from qual.checkpoints.io import load_weights
    with pytest.raises(QualError, match="no \\*.safetensors"):
        load_weights(noweights)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(target, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(QualError, match="unreadable safetensors"):
        load_weights(corrupt)


def test_draft_config_is_checked(tmp_path, tiny_pair):
    target, draft = tiny_pair
    d = tmp_path / "d"
    shutil.copytree(draft, d)
    conf = json.loads((d / "config.json").read_text())
    for key, value, message in [
        ("architectures", ["Qwen3ForCausalLM"], "DFlashDraftModel"),
        ("dflash_config", {"mask_token_id": 10_000, "target_layer_ids": [0]}, "not a vocabulary id"),
        ("dflash_config", {"mask_token_id": 1, "target_layer_ids": [4]}, "must be within 0..3"),
        ("dflash_config", {"mask_token_id": 1, "target_layer_ids": [1, 1]}, "name a layer twice"),
        ("layer_types", ["sliding_attention", "full_attention"], "sliding_window"),
    ]:
        (d / "config.json").write_text(json.dumps({**conf, key: value}))
        with pytest.raises(QualError, match=message):
            validate(cfg(target, d))


def test_missing_or_misshapen_tensor_is_named(tmp_path, tiny_pair):
    from safetensors.torch import load_file, save_file

    import torch

    from qual.runtime.backends import parse_backend
    from qual.runtime.models.qwen3 import Qwen3Target
    from qual.runtime.parallel import Comm
    from qual.runtime.models.base import ModelOptions
    from qual.runtime.registry import target_spec

    t = tmp_path / "t"
    shutil.copytree(tiny_pair[0], t)
    w = load_file(str(t / "model.safetensors"))
    w.pop("model.layers.1.mlp.up_proj.weight")
    save_file(w, str(t / "model.safetensors"))
    with pytest.raises(QualError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        Qwen3Target(t, target_spec(t).config, Comm(), torch.float32, (), parse_backend("pytorch"), ModelOptions())
    w["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(w, str(t / "model.safetensors"))
    with pytest.raises(QualError, match="has shape \\(3, 3\\)"):
        Qwen3Target(t, target_spec(t).config, Comm(), torch.float32, (), parse_backend("pytorch"), ModelOptions())


def test_mismatched_pair_is_rejected_before_any_process_starts(tmp_path, tiny_pair):
    """validate() (the driver's preflight) refuses a drafter of another width or another target's depth, naming both
    sides; an engine built anyway refuses it the same way."""
    from qual.runtime.engine import LLMEngine

    other = make_draft(tmp_path / "wide", hidden_size=32, head_dim=8)
    with pytest.raises(QualError, match=r"hidden_size/vocab_size 32/96 must match the target's \(64/96\)"):
        validate(cfg(tiny_pair[0], other))
    with pytest.raises(QualError, match="hidden_size/vocab_size 32/"):
        LLMEngine(cfg(tiny_pair[0], other))
    deep = make_target(tmp_path / "deep", num_hidden_layers=6)
    with pytest.raises(QualError, match="num_target_layers=4 but the target has 6 layers"):
        validate(cfg(deep, tiny_pair[1]))


def test_reference_profile_knobs_reach_the_runtime():
    from qual.engines.reference import engine_config
    from synthetic import synthetic_arm_config

    knobs = {"backend": "compiled+triton-gemm+triton-attention", "cuda_graph_sizes": [1, 4], "max_num_seqs": 3,
             "steps_per_launch": 2, "prefill_ahead": 5}
    arm = synthetic_arm_config(1, tp=1, device="cuda", dtype="bfloat16", extra={"reference": knobs})
    cfg = engine_config(arm)
    assert (cfg.backend, cfg.cuda_graph_sizes, cfg.max_num_seqs, cfg.steps_per_launch, cfg.prefill_ahead) == \
        ("compiled+triton-gemm+triton-attention", (1, 4), 3, 2, 5)
    default = engine_config(synthetic_arm_config(1, tp=1))
    assert (default.backend, default.steps_per_launch, default.prefill_ahead) == ("pytorch", 1, 0)
    with pytest.raises(QualError, match="fused needs tp 1"):  # a bad profile fails as the runtime says
        engine_config(synthetic_arm_config(1, tp=2, device="cuda", dtype="bfloat16", extra={"reference": {"backend": "fused"}}))


def test_a_checkpoint_problem_found_in_the_ranks_is_one_line_each(tmp_path, tiny_pair, capfd):
    """A drafter tensor of the wrong shape is found where the weights load, in every rank: rank 0 raises it, and the
    other ranks say it in one line each instead of a traceback apiece."""
    from safetensors.torch import load_file, save_file

    from qual.runtime.engine import LLMEngine

    draft = tmp_path / "draft"
    shutil.copytree(tiny_pair[1], draft)
    w = load_file(str(draft / "model.safetensors"))
    w["fc.weight"] = w["fc.weight"][:, :-1].contiguous()
    save_file(w, str(draft / "model.safetensors"))
    with pytest.raises(QualError, match="fc.weight"):
        LLMEngine(cfg(tiny_pair[0], draft, tp=2, dcp=2))
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert all(line.startswith("rank 1: error: ") and "fc.weight" in line for line in err.splitlines() if line), err


@pytest.mark.parametrize("part", ["fused-layer", "gluon-layer"])
def test_layer_parts_refuse_a_target_whose_layers_they_do_not_run(part):
    """The GLM target's layers are not Qwen3's: a backend naming fused-layer or gluon-layer is refused by name before
    its weights load, never run as the per-layer path silently."""
    from qual.paths import DATA_DIR
    from qual.runtime.model_runner import ModelRunner
    from qual.runtime.parallel import Comm
    from qual.runtime.registry import target_spec

    glm = DATA_DIR / "models" / "glm-toy" / "target"
    cfg = EngineConfig(str(glm), device="cuda", dtype="bfloat16", backend=part)
    with pytest.raises(QualError, match=f"{part} runs Qwen3 targets' layers only"):
        ModelRunner(cfg, Comm(), target_spec(glm), None)  # a CPU Comm: nothing asks for a GPU before the refusal
