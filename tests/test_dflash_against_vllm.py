"""The drafter format and DFlash2's math against the installed vLLM's own source (.venv-vllm; skipped without it).

1. Keys: every attribute vLLM's DFlash / DFlash2 loaders and speculators read from the draft config or its
   dflash_config (found by parsing their source with ast) is accepted or refused by name by qual.checkpoints.dflash.
   A key vLLM starts reading fails this test until the format module handles it.
2. Resolution: for a set of drafter configs, vLLM itself (its config loader, _resolve_layer_attention, the mask-token
   and aux-layer helpers, set_default_rope_theta) and DFlashConfig agree on every layer's window and causality, the
   RoPE base, the head shapes, the mask token and the target layers; configs vLLM rejects are refused here too.
3. Math: vLLM's CPU `_grouped_conv` and `_score_edges` equal the runtime's grouped_conv and selector_edges.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from qual.checkpoints import dflash as fmt
from qual.errors import QualError
from qual.runtime.models.dflash import grouped_conv, selector_edges
from qual.runtime.spec_decode import candidate_walk

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SITE = sorted((REPO / ".venv-vllm" / "lib").glob("python3*/site-packages/vllm"))

# Where vLLM reads the draft config: the DFlash/DFlash2 models, the DFlash/DFlash2 speculator packages, and the two
# helpers they call with the draft config (mask token, aux layers).
SOURCES = ["model_executor/models/qwen3_dflash.py", "model_executor/models/qwen3_dflash2.py",
           "v1/worker/gpu/spec_decode/dflash/*.py", "v1/worker/gpu/spec_decode/dflash2/*.py"]
HELPERS = {"v1/worker/gpu/spec_decode/utils.py": "get_parallel_drafting_token_id",
           "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py": "get_eagle3_aux_layers_from_config"}
# The names the draft config goes by in those files (its dflash_config: DICTS).
CONFIG = {"config", "self.config", "hf_config", "self.draft_model_config.hf_config", "dflash_model.config",
          "speculative_config.draft_model_config.hf_config", "spec_config.draft_model_config.hf_config"}
DICTS = {"dflash_config", "drafter_config", "draft_config"}

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists() or not SITE, reason=".venv-vllm absent: run `make vllm-venv`")


def _is_dflash_config(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return text in DICTS or text.endswith(".dflash_config") or "'dflash_config'" in text


def _keys(tree: ast.AST, consts: dict[str, str]) -> tuple[set[str], set[str]]:
    """(top-level keys, dflash_config keys) read in tree: getattr/hasattr(config, "k"), config.k, d.get("k"),
    d["k"] (a class constant as the key too), "k" in d."""
    top, sub = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr"):
            if ast.unparse(n.args[0]) in CONFIG and isinstance(n.args[1], ast.Constant):
                top.add(n.args[1].value)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and ast.unparse(n.value) in CONFIG:
            top.add(n.attr)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" \
                and _is_dflash_config(n.func.value):
            assert isinstance(n.args[0], ast.Constant), ast.unparse(n)
            sub.add(n.args[0].value)
        elif isinstance(n, ast.Subscript) and _is_dflash_config(n.value):
            s = n.slice
            key = s.value if isinstance(s, ast.Constant) else consts.get(getattr(s, "attr", None))
            assert key is not None, f"unresolved dflash_config key: {ast.unparse(n)}"
            sub.add(key)
        elif isinstance(n, ast.Compare) and isinstance(n.ops[0], ast.In) and _is_dflash_config(n.comparators[0]):
            sub.add(n.left.value)
    return top, sub


def vllm_config_keys() -> tuple[set[str], set[str]]:
    site = SITE[0]
    top, sub = set(), set()
    files = [f for pattern in SOURCES for f in sorted(site.glob(pattern))]
    assert len(files) >= 5, files
    for f in files:
        tree = ast.parse(f.read_text())
        consts = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name)}
        t, s = _keys(tree, consts)
        top |= t
        sub |= s
    for f, name in HELPERS.items():
        fn = next(n for n in ast.walk(ast.parse((site / f).read_text())) if isinstance(n, ast.FunctionDef) and n.name == name)
        t, s = _keys(fn, {})
        top |= t
        sub |= s
    return top, sub


def test_every_key_vllm_reads_is_accepted_or_refused_by_name():
    top, sub = vllm_config_keys()
    assert {"is_causal", "attention_bias", "sliding_window", "is_neox_style"} <= top  # the parse finds them
    assert {"causal", "use_swa", "swa_window_size", "conv_kernel_size", "selector_top_k"} <= sub
    assert not top - set(fmt.ACCEPTED) - set(fmt.REFUSED), "vLLM reads top-level keys the format does not handle"
    assert not sub - set(fmt.DFLASH_ACCEPTED) - set(fmt.DFLASH_REFUSED), "vLLM reads dflash_config keys not handled"


BASE = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 96, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "block_size": 4, "num_target_layers": 4,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 2]}}
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
# Variants of BASE: config overrides, dflash_config overrides (None deletes).
VARIANTS = {
    "plain, no rope_theta, no head_dim, no kv heads": ({"head_dim": None, "num_key_value_heads": None}, {}),
    "mixed, use_sliding_window": ({"layer_types": MIXED, "use_sliding_window": True, "sliding_window": 5}, {}),
    "mixed, window dropped without use_sliding_window": ({"layer_types": MIXED, "sliding_window": 5}, {}),
    "swa_window_size beats sliding_window": ({"layer_types": MIXED, "use_sliding_window": True, "sliding_window": 5},
                                             {"swa_window_size": 7}),
    "use_swa on full layer_types": ({"layer_types": ["full_attention"] * 3}, {"use_swa": True, "swa_window_size": 3}),
    "dflash_config.causal": ({"layer_types": MIXED}, {"causal": True, "swa_window_size": 6}),
    "is_causal beats dflash_config.causal": ({"layer_types": MIXED, "is_causal": False},
                                             {"causal": True, "swa_window_size": 6}),
    "no layer_types: max_window_layers": ({"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}, {}),
    "rope_parameters theta beats rope_theta": ({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default",
                                                                                      "rope_theta": 2e4}}, {}),
    "rope_theta only": ({"rope_theta": 3e5}, {}),
    "aux ids beat target_layer_ids": ({"eagle_aux_hidden_state_layer_ids": [2, 3]}, {}),
    "target layers listed out of order": ({}, {"target_layer_ids": [2, 0, 1]}),
    "the last target layer": ({}, {"target_layer_ids": [3, 1]}),
    "a target layer twice": ({}, {"target_layer_ids": [2, 0, 2]}),
    "top-level mask_token_id, dflash layer_ids": ({"mask_token_id": 7}, {"mask_token_id": None, "target_layer_ids": None,
                                                                          "layer_ids": [1, 3]}),
}

VLLM_SIDE = textwrap.dedent('''
    import json, sys, types
    import torch
    from vllm.transformers_utils.config import get_config, set_default_rope_theta
    import vllm.model_executor.models.qwen3_dflash as m
    from vllm.model_executor.models.qwen3_dflash2 import _grouped_conv, _score_edges
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.model_executor.models.interfaces import EagleModelMixin

    # Mixed sliding/full layers ask whether Model Runner V2 runs; answer yes (it is what would load them).
    m.get_current_vllm_config = lambda: types.SimpleNamespace(use_v2_model_runner=True)
    root = sys.argv[1]
    out = {}
    for name in json.load(open(root + "/names.json")):
        try:
            c = get_config(root + "/" + name, trust_remote_code=False)
            set_default_rope_theta(c, default_theta=1000000)  # what DFlashQwen3DecoderLayer does
            spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=c))
            aux = list(get_eagle3_aux_layers_from_config(spec))
            target = types.SimpleNamespace(_cache_aux_pp_layout=lambda: None)  # the layers a target model captures
            EagleModelMixin._set_aux_hidden_state_layers(target, tuple(aux))
            out[name] = {"layers": [list(m._resolve_layer_attention(c, i)) for i in range(c.num_hidden_layers)],
                         "rope_theta": c.rope_parameters["rope_theta"], "head_dim": c.head_dim,
                         "num_key_value_heads": c.num_key_value_heads, "mask": get_parallel_drafting_token_id(c),
                         "aux": aux, "captured": list(target.aux_hidden_state_layers)}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    t = torch.load(root + "/math.pt")
    conv = _grouped_conv(t["x"], t["delta"], t["base"], t["block"], t["groups"], t["group_size"], t["taps"])
    hidden = t["hidden"] @ t["projection"].T
    edges = _score_edges(t["pred"], t["succ"], t["cand"], t["unary"], hidden, t["anchor"], t["cand"].shape[-1])
    torch.save({"conv": conv, "edges": edges}, root + "/vllm_math.pt")
    json.dump(out, open(root + "/vllm.json", "w"))
''')


def _config(name: str) -> dict:
    over, sub = VARIANTS[name]
    cfg = json.loads(json.dumps(BASE))
    for k, v in over.items():
        cfg.pop(k) if v is None else cfg.__setitem__(k, v)
    for k, v in sub.items():
        cfg["dflash_config"].pop(k) if v is None else cfg["dflash_config"].__setitem__(k, v)
    return cfg


def _math_inputs():
    g = torch.Generator().manual_seed(0)
    N, H, taps, gs, k, r, V = 12, 64, 3, 16, 4, 8, 96  # 3 blocks of 4 rows
    d = dict(x=torch.randn(N, H, generator=g, dtype=torch.float64),
             delta=torch.randn(N, taps, H // gs, generator=g, dtype=torch.float64),
             base=torch.randn(taps, H, generator=g, dtype=torch.float64), block=4, groups=H // gs, group_size=gs,
             taps=taps, pred=torch.randn(V, r, generator=g, dtype=torch.float64),
             succ=torch.randn(V, r, generator=g, dtype=torch.float64),
             cand=torch.randint(0, V, (2, 3, k), generator=g), unary=torch.randn(2, 3, k, generator=g, dtype=torch.float64),
             hidden=torch.randn(2, 3, H, generator=g, dtype=torch.float64),
             projection=torch.randn(r, H, generator=g, dtype=torch.float64), anchor=torch.tensor([5, 17]))
    return d


@pytest.fixture(scope="module")
def vllm_side(tmp_path_factory):
    """One vLLM process: its resolution of every variant and its DFlash2 functions on fixed inputs."""
    root = tmp_path_factory.mktemp("vllm_side")
    for i, name in enumerate(VARIANTS):
        (root / f"v{i}").mkdir()
        (root / f"v{i}" / "config.json").write_text(json.dumps(_config(name)))
    (root / "names.json").write_text(json.dumps([f"v{i}" for i in range(len(VARIANTS))]))
    torch.save(_math_inputs(), root / "math.pt")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_SIDE, str(root)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((root / "vllm.json").read_text()), torch.load(root / "vllm_math.pt"), root


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_configs_resolve_as_vllm_resolves_them(vllm_side, variant):
    got = vllm_side[0][f"v{list(VARIANTS).index(variant)}"]
    path = vllm_side[2] / f"v{list(VARIANTS).index(variant)}"
    cfg = _config(variant)
    if "error" in got:  # vLLM refuses it: so does the format, naming what is missing
        with pytest.raises(QualError, match="window"):
            fmt.DFlashConfig.from_json(cfg, path)
        assert "window size" in got["error"]
        return
    if len(got["captured"]) != len(got["aux"]):  # fc takes one feature per id, the target captures a set: vLLM fails
        with pytest.raises(QualError, match="name a layer twice"):
            fmt.DFlashConfig.from_json(cfg, path)
        return
    ours = fmt.DFlashConfig.from_json(cfg, path)
    n = ours.layers.num_hidden_layers
    assert [[ours.layer_window(i), ours.layer_causal(i)] for i in range(n)] == got["layers"]
    assert ours.layers.rope_theta == got["rope_theta"]
    assert (ours.layers.head_dim, ours.layers.num_key_value_heads) == (got["head_dim"], got["num_key_value_heads"])
    assert ours.mask_token_id == got["mask"]
    assert [i + 1 for i in ours.target_layer_ids] == got["aux"]  # fc's width: one feature per listed id
    assert [i + 1 for i in ours.aux_layer_ids] == got["captured"]  # concatenated in the order vLLM captures them


def test_grouped_conv_and_selector_edges_equal_vllms(vllm_side):
    want = vllm_side[1]
    t = _math_inputs()
    torch.testing.assert_close(grouped_conv(t["x"], t["delta"], t["base"], t["block"], t["group_size"]), want["conv"],
                               rtol=0, atol=1e-12)
    edges = t["unary"][:, :, None, :] + selector_edges(t["pred"], t["succ"], t["projection"], t["cand"], t["hidden"],
                                                       t["anchor"])
    torch.testing.assert_close(edges, want["edges"], rtol=0, atol=1e-12)


def walk_as_the_kernel(candidates: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """vLLM's _selector_walk_kernel at temperature 0, pointer arithmetic and all: step s of row b reads the k scores at
    ((b * steps + s) * k + previous) * k and takes the first maximum."""
    P, steps, k = candidates.shape
    flat_scores, flat_cand = scores.reshape(-1).tolist(), candidates.reshape(-1).tolist()
    out = []
    for b in range(P):
        previous, row = 0, []
        for s in range(steps):
            base = ((b * steps + s) * k + previous) * k
            block = flat_scores[base : base + k]
            previous = block.index(max(block))
            row.append(flat_cand[(b * steps + s) * k + previous])
        out.append(row)
    return torch.tensor(out)


def test_candidate_walk_is_vllms_walk():
    g = torch.Generator().manual_seed(3)
    candidates = torch.randint(0, 50, (5, 6, 4), generator=g)
    scores = torch.randint(0, 3, (5, 6, 4, 4), generator=g).double()  # few values: many ties (the first one wins)
    assert torch.equal(candidate_walk(candidates, scores), walk_as_the_kernel(candidates, scores))
    scores = torch.randn(5, 6, 4, 4, generator=g, dtype=torch.float64)
    assert torch.equal(candidate_walk(candidates, scores), walk_as_the_kernel(candidates, scores))
