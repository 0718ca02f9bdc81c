"""DCP N reproduces DCP1 (the best invariant this project has), on real rank processes over gloo."""

import pytest
import torch

from runtime_helpers import prompts, run

pytestmark = pytest.mark.slow  # engine processes and whole runs: scheduled first (tests/conftest.py)


@pytest.fixture(scope="module")
def control(tiny_pair):
    return run(*tiny_pair, logits=True)


@pytest.mark.parametrize("dcp,interleave,dcp_comm", [(2, 1, "a2a"), (2, 2, "ag_rs"), (4, 1, "ag_rs"), (4, 2, "a2a")])
def test_dcp_greedy_tokens_and_proposals_equal_dcp1(tiny_pair, control, dcp, interleave, dcp_comm):
    base, base_logits = control
    out, logits = run(*tiny_pair, tp=dcp, dcp=dcp, interleave=interleave, dcp_comm=dcp_comm, logits=True)
    assert [r.output_token_ids for r in out] == [r.output_token_ids for r in base]
    # replicated draft KV: every proposal at every step equals DCP1's, so acceptance is identical
    assert [r.draft_steps for r in out] == [r.draft_steps for r in base]
    assert [r.accepted_per_position for r in out] == [r.accepted_per_position for r in base]
    torch.testing.assert_close(logits, base_logits, rtol=0, atol=1e-10)


@pytest.fixture(scope="module")
def pair_tp8(tmp_path_factory):
    """The tiny pair with 8 query heads over one KV head: TP 8 takes DCP 1, 2, 4 and 8."""
    from checkpoints import make_draft, make_target

    root = tmp_path_factory.mktemp("tp8")
    return make_target(root / "target", num_attention_heads=8), make_draft(root / "draft", num_attention_heads=8)


def test_invariant_merge_makes_gqa_dcp_n_dcp_1_bit_for_bit(pair_tp8):
    """dcp_comm invariant at TP 8 (GQA: 8 query heads share one KV head): DCP N's float32 prompt logits are DCP 1's
    bit for bit, and so are its tokens, proposals and acceptance (bfloat16 and the other paths: the GLM target's test
    in tests/test_glm5_runtime.py, the shard math in tests/test_dcp_invariant.py)."""
    reqs = prompts(3, max_tokens=8)  # 3, 17 and 40 tokens
    base, base_logits = run(*pair_tp8, tp=8, dtype="float32", dcp_comm="invariant", logits=True, requests=reqs)
    for dcp in (2, 4, 8):
        out, logits = run(*pair_tp8, tp=8, dcp=dcp, dtype="float32", dcp_comm="invariant", logits=True, requests=reqs)
        assert torch.equal(logits, base_logits), dcp
        assert [(r.output_token_ids, r.draft_steps, r.accepted_per_position) for r in out] == \
            [(r.output_token_ids, r.draft_steps, r.accepted_per_position) for r in base]


def test_float32_logits_within_tolerance(tiny_pair, control):
    _, base_logits = control
    _, logits = run(*tiny_pair, tp=4, dcp=4, interleave=2, dtype="float32", logits=True)
    # Stated tolerance: float32 DCP4 logits within 1e-4 absolute of float64 DCP1.
    assert (logits - base_logits).abs().max().item() < 1e-4


def test_tp_without_dcp_equals_single_rank(tiny_pair, control):
    out, _ = run(*tiny_pair, tp=4, dcp=2)
    assert [r.output_token_ids for r in out] == [r.output_token_ids for r in control[0]]


def test_legacy_sharded_draft_kv_changes_proposals_not_outputs(tiny_pair, control):
    base, _ = control
    out, _ = run(*tiny_pair, tp=4, dcp=4, draft_kv="sharded")
    assert [r.output_token_ids for r in out] == [r.output_token_ids for r in base]  # the target verifies everything
    steps = [(a, b) for r, c in zip(out, base) for a, b in zip(r.draft_steps, c.draft_steps) if a[0] == b[0]]
    assert steps and sum(a[1] != b[1] for a, b in steps) / len(steps) > 0.2


def test_sampling_is_seeded_identical_across_dcp_and_lossless(tiny_pair):
    spec_dcp1, _ = run(*tiny_pair, temperature=0.8)
    spec_dcp4, _ = run(*tiny_pair, tp=4, dcp=4, temperature=0.8)
    plain, _ = run(tiny_pair[0], None, temperature=0.8)
    greedy, _ = run(tiny_pair[0], None)
    outs = lambda rs: [r.output_token_ids for r in rs]  # noqa: E731
    assert outs(spec_dcp1) == outs(spec_dcp4) == outs(plain)
    assert outs(plain) != outs(greedy)


def test_batch_composition_does_not_change_outputs(tiny_pair, control):
    one_at_a_time, _ = run(*tiny_pair, max_num_seqs=1)
    assert [r.output_token_ids for r in one_at_a_time] == [r.output_token_ids for r in control[0]]


def test_statistics_are_consistent(control):
    for r in control[0]:
        assert r.draft_tokens == 3 * r.drafts
        assert r.accepted_tokens == sum(r.accepted_per_position)
        assert all(a >= b for a, b in zip(r.accepted_per_position, r.accepted_per_position[1:]))
        assert len(r.output_token_ids) == 20 or r.finish_reason == "stop"
        assert len(r.top2_margins) == len(r.output_token_ids)


def test_compiled_decode_equals_eager(tiny_pair):
    """torch.compile'd decode (inductor; the GPU bench's --compile) computes the same tokens and proposals."""
    one = prompts()[1:2]  # one request: one padded size, one compilation
    eager, _ = run(*tiny_pair, static_shapes=True, max_model_len=128, requests=one)
    compiled, _ = run(*tiny_pair, static_shapes=True, max_model_len=128, requests=one, backend="compiled")
    assert [r.output_token_ids for r in compiled] == [r.output_token_ids for r in eager]
    assert [r.draft_steps for r in compiled] == [r.draft_steps for r in eager]


def test_compiled_entries_go_with_their_engine(tiny_pair):
    """Dynamo's entries are per code object across engines, and past its limit it would silently run
    uncompiled (seen on GPU: later engines of a process computed other tokens): a closed engine drops them."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import LLMEngine
    from qual.runtime.model_runner import ModelRunner

    code = ModelRunner.static_step.__code__
    cfg = EngineConfig(str(tiny_pair[0]), str(tiny_pair[1]), ParallelConfig(1, 1, 1), CacheConfig(block_size=4),
                       dtype="float64", static_shapes=True, max_model_len=128, backend="compiled")
    with LLMEngine(cfg) as engine:
        engine.generate(prompts(2, max_tokens=6)[1:], SamplingParams(max_tokens=6))
        assert len(_debug_get_cache_entry_list(code)) >= 1  # rank 0 runs in this process
    assert _debug_get_cache_entry_list(code) == []
    assert torch._dynamo.config.fail_on_recompile_limit_hit  # a limit hit is an error, never a silent fallback


def test_graph_shaped_static_decode_equals_dynamic(tiny_pair, control):
    """The padded, fixed-width decode a CUDA graph replays computes the same tokens and proposals (run eagerly here)."""
    out, _ = run(*tiny_pair, tp=2, dcp=2, static_shapes=True, max_model_len=128)
    assert [r.output_token_ids for r in out] == [r.output_token_ids for r in control[0]]
    assert [r.draft_steps for r in out] == [r.draft_steps for r in control[0]]
