"""Prefill at padded, bucketed shapes (what the prefill CUDA graphs capture: qual/runtime/prefill_graphs.py) computes
what the eager prefill computes: the same prompt logits, the same draft context (hence the same proposals and
acceptance), the same text. Run here eagerly under static_shapes; tests/test_gpu.py replays it from graphs."""

from dataclasses import replace

import pytest
import torch

from glm5_checkpoints import make_glm5, tiny_text
from runtime_helpers import prompts
from qual.errors import QualError
from qual.runtime.config import CacheConfig, EngineConfig, SamplingParams
from qual.runtime.engine import LLMEngine
from qual.runtime.prefill_graphs import bucket

pytestmark = pytest.mark.slow


def engine_config(target, draft, prefill_graph_tokens, max_num_seqs=8):
    return EngineConfig(str(target), str(draft) if draft else None, cache=CacheConfig(block_size=4, memory_bytes=2**22),
                        dtype="float64", static_shapes=True, max_model_len=128, max_num_seqs=max_num_seqs,
                        prefill_graph_tokens=prefill_graph_tokens)


def generate(target, draft, prefill_graph_tokens, requests, **kw):
    with LLMEngine(engine_config(target, draft, prefill_graph_tokens, **kw)) as engine:
        out = engine.generate(requests, SamplingParams(max_tokens=20))
        return out, engine.graph_capture()["prefill"]


def same(a, b):
    keys = ("output_token_ids", "draft_steps", "accepted_per_position", "finish_reason")
    return [[getattr(r, k) for k in keys] for r in a] == [[getattr(r, k) for k in keys] for r in b]


def test_buckets_are_rows_by_powers_of_two_and_lengths_by_quarter_octaves():
    assert bucket(1, 1) == (1, 16) and bucket(3, 17) == (4, 32) and bucket(8, 32) == (8, 32) and bucket(5, 33) == (8, 48)
    assert [bucket(2, n)[1] for n in (64, 65, 100, 128, 129, 256, 257, 282, 513)] == [64, 80, 112, 128, 160, 256, 320, 320, 640]
    for n in range(65, 5000):  # past 64 tokens at most a fifth of a row is padding, and every length fits
        length = bucket(1, n)[1]
        assert n <= length and length - n < length / 5, n


def test_padded_prefill_gives_the_eager_prompt_logits(tiny_pair):
    ps = [list(r.prompt_token_ids) for r in prompts(5)]  # 3..40 tokens: rows of length 0 and tails of padding
    with LLMEngine(engine_config(*tiny_pair, 0)) as engine:
        eager = engine.prompt_logits(ps)
    with LLMEngine(engine_config(*tiny_pair, 4096)) as engine:
        padded = engine.prompt_logits(ps)
        record = engine.graph_capture()["prefill"]
    assert record["padded_chunks"] == 1 and record["eager_chunks"] == 0
    torch.testing.assert_close(padded, eager, rtol=0, atol=1e-12)


def test_chunks_of_unsorted_prompts_come_back_in_the_steps_order_with_their_choices(tiny_pair):
    """Prompts run in length-sorted chunks (here some padded, one above the padded limit and eager): logits and the
    greedy choices read back for the first tokens are each prompt's own, in the order the step gave them."""
    ps = [list(r.prompt_token_ids) for r in prompts(6)]
    ps = [ps[i] for i in (4, 0, 5, 2, 1, 3)]
    with LLMEngine(engine_config(*tiny_pair, 0)) as engine:
        alone = torch.cat([engine.prompt_logits([p]) for p in ps])
    cfg = replace(engine_config(*tiny_pair, 63), max_prefill_tokens=40)  # chunks of 3+9+11 (eager), 17, 26, 40 (eager)
    with LLMEngine(cfg) as engine:
        logits = engine.prompt_logits(ps)
        first = engine.runner.first_tokens.tolist()
        record = engine.graph_capture()["prefill"]
    assert record["padded_chunks"] >= 2 and record["eager_chunks"] >= 1, record
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-12)
    assert first == alone.argmax(dim=-1).tolist()


@pytest.mark.parametrize("max_num_seqs", [8, 3])  # one chunk; chunks of one or two as requests finish
def test_speculative_decoding_after_a_padded_prefill_is_unchanged(tiny_pair, max_num_seqs):
    """The draft context written by the padded prefill is the eager one: proposals and acceptance agree."""
    reqs = [replace(r, max_tokens=m) for r, m in zip(prompts(8), (20, 7, 13, 20, 3, 16, 9, 20))]
    eager, off = generate(*tiny_pair, 0, reqs, max_num_seqs=max_num_seqs)
    padded, on = generate(*tiny_pair, 4096, reqs, max_num_seqs=max_num_seqs)
    assert off["status"] == "off" and off["eager_chunks"] > 0 and off["padded_chunks"] == 0
    assert on["padded_chunks"] == off["eager_chunks"] and on["eager_chunks"] == 0
    assert same(padded, eager)


def test_a_chunk_above_the_limit_runs_eagerly_and_is_counted(tiny_pair):
    reqs = prompts(8)  # one chunk of 8 prompts up to 40 tokens: 8 x 48 padded tokens
    assert bucket(8, max(len(r.prompt_token_ids) for r in reqs)) == (8, 48)
    eager, _ = generate(*tiny_pair, 0, reqs)
    out, record = generate(*tiny_pair, 8 * 48 - 1, reqs)
    assert record["eager_chunks"] == 1 and record["padded_chunks"] == 0 and same(out, eager)


def test_a_recurrent_state_cache_is_refused_by_name(tmp_path):
    """The GLM geometry (KDA state, MLA latents, DSA pooled keys and ring): padding would enter the state; the
    record says why its prefill stays eager."""
    target = make_glm5(tmp_path / "glm", tiny_text())
    out, record = generate(target, None, 4096, [replace(r, max_tokens=4) for r in prompts(3, vocab=96)])
    assert record["status"] == "unsupported" and "state" in record["detail"] and record["eager_chunks"] >= 1
    assert record["padded_chunks"] == 0 and not record["compiled"]
    with pytest.raises(QualError, match="compiled-prefill: the GLM-5 target runs the reference backend only"):
        LLMEngine(replace(engine_config(target, None, 4096), backend="compiled-prefill"))


def test_a_negative_limit_is_refused(tiny_pair):
    with pytest.raises(QualError, match="prefill_graph_tokens"):
        engine_config(*tiny_pair, -1)


def test_a_failed_capture_leaves_prefill_eager_and_says_why(tiny_pair, monkeypatch):
    """A bucket whose capture fails (out of memory, say) does not fail the run: its chunk and every later one
    prefill eagerly, with the same tokens, and the record names the failure. (The capture itself needs CUDA: the
    failure is injected where it would be raised.)"""
    from qual.runtime.prefill_graphs import PrefillGraphs

    def fail(self, b):
        raise RuntimeError("CUDA out of memory (injected)")

    reqs = [replace(r, max_tokens=m) for r, m in zip(prompts(8), (20, 7, 13, 20, 3, 16, 9, 20))]
    eager, _ = generate(*tiny_pair, 0, reqs, max_num_seqs=3)
    monkeypatch.setattr(PrefillGraphs, "_capture", fail)
    with LLMEngine(engine_config(*tiny_pair, 4096, max_num_seqs=3)) as engine:
        engine.runner.prefill_graphs.capture = True  # as on CUDA
        out = engine.generate(reqs, SamplingParams(max_tokens=20))
        record = engine.graph_capture()["prefill"]
    assert record["status"] == "failed" and "out of memory (injected)" in record["detail"]
    assert record["padded_chunks"] == 0 and record["eager_chunks"] >= 3
    assert same(out, eager)


def test_a_compiled_prefill_gives_the_eager_one_with_a_few_compiles_for_every_bucket(tiny_pair):
    """Backend part compiled-prefill: the padded prefill through torch.compile, its shapes symbolic once they change
    (Backend.compile's dynamic=None). Eight prompts in buckets of 1, 2, 4 and 8 rows at several lengths: the prompt
    logits the eager prefill gives, the same text, drafts and acceptance after them, and at most four compiles (a
    compile a bucket would be five, and more as the generate admits)."""
    from torch._dynamo.utils import counters

    reqs = [replace(r, max_tokens=m) for r, m in zip(prompts(8), (20, 7, 13, 20, 3, 16, 9, 20))]
    ps = [list(r.prompt_token_ids) for r in reqs]
    chunks = [ps[:1], ps[1:3], ps[3:7], ps, ps[4:5], ps[2:4], ps[5:]]
    with LLMEngine(engine_config(*tiny_pair, 4096)) as engine:
        eager = [engine.prompt_logits(c) for c in chunks]
        eager_out = engine.generate(reqs, SamplingParams(max_tokens=20))
    counters.clear()
    cfg = replace(engine_config(*tiny_pair, 4096), backend="compiled-prefill")
    with LLMEngine(cfg) as engine:
        compiled = [engine.prompt_logits(c) for c in chunks]
        out = engine.generate(reqs, SamplingParams(max_tokens=20))
        record = engine.graph_capture()["prefill"]
    assert record["compiled"] and record["eager_chunks"] == 0
    assert len({bucket(len(c), max(map(len, c))) for c in chunks}) == 5
    assert 2 <= counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    # Within float32's reach, not float64's: RoPE's angles are float32 (as transformers computes them), and inductor's
    # vectorised cos and sin of them differ from eager's by up to one float32 unit in the last place (6e-8)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert same(out, eager_out)


def test_compiled_prefill_is_refused_where_prefill_never_runs_at_padded_shapes(tiny_pair):
    with pytest.raises(QualError, match="compiled-prefill compiles the prefill at padded shapes"):
        replace(engine_config(*tiny_pair, 4096), static_shapes=False, backend="compiled-prefill")
    with pytest.raises(QualError, match="compiled-prefill compiles the prefill at padded shapes"):
        replace(engine_config(*tiny_pair, 0), backend="compiled-prefill")
