"""Sliding-window draft layers: vLLM's per-query-token window, and a draft cache that stays bounded by the window.

Fidelity: every draft step of an engine run (a drafter with one sliding and one full layer) equals an independent
recomputation over the whole sequence with an explicit mask (tests/dflash_reference.py), for windows smaller than,
equal to and larger than the block, causal (sliding_attention layers) and not (use_swa with dflash_config.causal
false). Memory: the replicated sliding group's bytes per rank under DCP do not grow as the prompt grows to 8x the
window (the prefill stores only the prompt's tail there); the legacy sharded mode shards the sliding group too,
and stays bounded.
"""

import pytest
import torch

from checkpoints import make_draft, make_target
from dflash_reference import check_draft_steps
from qual.runtime.cache_views import draft_mask
from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine
from qual.runtime.paged import KeyView
from runtime_helpers import prompts, run

BLOCK = 4  # the drafter's block: the last token + K = 3 drafts
SLIDING = ("sliding_attention", "full_attention")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("win") / "target", live_tokens=3)


# (window, layer types, options): smaller than, equal to and larger than the block; causal and not
CASES = {
    "w2-causal": (2, SLIDING, {}),
    "w4-causal": (BLOCK, SLIDING, {}),
    "w11-causal": (11, SLIDING, {}),
    "w3-noncausal-use_swa": (3, ("full_attention", "full_attention"), {"use_swa": True, "causal": False}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_per_query_windows_equal_masked_full_attention(target, tmp_path, case):
    window, types, options = CASES[case]
    draft = make_draft(tmp_path / "draft", block_size=BLOCK, layer_types=types, sliding_window=window, options=options)
    out, _ = run(target, draft, requests=prompts(3))
    assert sum(r.accepted_tokens for r in out) > 0  # steps commit several tokens: the window slides by more than one
    assert check_draft_steps(target, draft, out, BLOCK - 1) > 20


def test_draft_mask_is_per_query():
    """One request, context at 0..5, block at 6..9: each query's window starts at its own position."""
    keys = KeyView(torch.zeros(1, 6, dtype=torch.long), torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool),
                   torch.tensor([6], dtype=torch.int32))
    block = torch.arange(6, 10)[None]
    m = draft_mask(keys, block, window=3, causal=True)[0].int()
    assert m.tolist() == [[0, 0, 0, 0, 1, 1, 1, 0, 0, 0],   # p=6 sees 4, 5, 6
                          [0, 0, 0, 0, 0, 1, 1, 1, 0, 0],   # p=7 sees 5, 6, 7
                          [0, 0, 0, 0, 0, 0, 1, 1, 1, 0],
                          [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]]
    m = draft_mask(keys, block, window=3, causal=False)[0].int()
    assert m[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 0]  # non-causal: |p - q| < window, ahead too
    assert draft_mask(keys, block, window=None, causal=False).all()


def _peak(target, draft, prompt_len, draft_kv="replicated", window=8):
    cfg = EngineConfig(str(target), str(draft), ParallelConfig(2, 2), CacheConfig(block_size=4, memory_bytes=2**22),
                       draft_kv=draft_kv, dtype="float32", max_model_len=prompt_len + 16)
    req = GenerationRequest("r", tuple(torch.randint(0, 90, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()), 6)
    with LLMEngine(cfg) as engine:
        out = engine.generate([req], SamplingParams(max_tokens=6))
        memory = engine.memory()
    return out[0], memory


@pytest.fixture(scope="module")
def windowed(target, tmp_path_factory):
    return make_draft(tmp_path_factory.mktemp("wd") / "draft", block_size=BLOCK, layer_types=SLIDING, sliding_window=8)


@pytest.mark.parametrize("draft_kv", ["replicated", "sharded"])
def test_sliding_group_bytes_per_rank_stay_bounded_by_the_window(target, windowed, draft_kv):
    """DCP 2: prompts of 1x and 8x the window (8 and 64 tokens). The sliding group's peak bytes per rank stay at the
    bound its window sets (window + the verify block, one block of slack); the full draft group grows with the prompt."""
    short, short_mem = _peak(target, windowed, 8, draft_kv)
    long, long_mem = _peak(target, windowed, 64, draft_kv)
    sliding, full = long_mem["draft_sliding"], long_mem["draft"]
    assert sliding["replication"] == full["replication"] == draft_kv  # the legacy mode shards the sliding group too
    n = 2 if draft_kv == "sharded" else 1
    bound_blocks = -(-(8 + BLOCK) // (4 * n)) + 1
    bound = bound_blocks * sliding["block_bytes"]
    assert 0 < short_mem["draft_sliding"]["peak_bytes"] <= bound and 0 < sliding["peak_bytes"] <= bound
    assert full["peak_bytes"] >= 4 * short_mem["draft"]["peak_bytes"]  # the full group grows with the prompt
    assert long.drafts > 0


def test_target_layers_listed_out_of_order_with_the_last_one(target, tmp_path):
    """target_layer_ids [3, 1] (the last target layer, then an earlier one): the features are concatenated in
    ascending layer order, as vLLM captures them, and the last layer's is its output before the final norm; every
    draft step equals the independent recomputation, which reads them in that order."""
    draft = make_draft(tmp_path / "draft", block_size=BLOCK, target_layer_ids=(3, 1))
    out, _ = run(target, draft, requests=prompts(3))
    assert sum(r.accepted_tokens for r in out) > 0
    assert check_draft_steps(target, draft, out, BLOCK - 1) > 20
