"""Async decode (a greedy step launched before the last one's results are read, the device advancing its inputs:
spec_decode.advance) computes what step-by-step decoding computes, request for request. Run here eagerly at the
CUDA graphs' static shapes, the path the graphs replay; tests/test_gpu.py replays it from graphs."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from checkpoints import make_draft
from glm5_checkpoints import make_glm5, tiny_text
from runtime_helpers import prompts
from qual.runtime.config import CacheConfig, EngineConfig, SamplingParams
from qual.runtime.cuda_graphs import DecodeGraphs
from qual.runtime.engine import LLMEngine
from qual.runtime.steps import DecodeStep, PrefillStep

pytestmark = pytest.mark.slow


def decode(target, draft, async_decode, max_num_seqs=8, requests=None, temperature=0.0, static_shapes=True,
           rows_retired=None, steps_per_launch=1, launches=None, prefill_ahead=0, joined=None):
    cfg = EngineConfig(str(target), str(draft) if draft else None, cache=CacheConfig(block_size=4, memory_bytes=2**22),
                       dtype="float64", static_shapes=static_shapes, max_model_len=128, max_num_seqs=max_num_seqs,
                       async_decode=async_decode, steps_per_launch=steps_per_launch, prefill_ahead=prefill_ahead)
    # Lengths differ, so requests finish at different steps (and some at EOS): batches change mid-run.
    reqs = requests or [replace(r, max_tokens=m) for r, m in zip(prompts(8), (20, 7, 13, 20, 3, 16, 9, 20))]
    with LLMEngine(cfg) as engine:
        out = engine.generate(reqs, SamplingParams(temperature=temperature, seed=7, max_tokens=20))
        record = engine.decode_record()
        taken = async_decode and static_shapes
        assert record == {"async": taken, "steps_ahead": engine.steps_ahead, "rows_retired": engine.rows_retired,
                          "steps_per_launch": steps_per_launch if taken else 1,
                          "launches": {str(k): v for k, v in sorted(engine.launches.items())}}
        if launches is not None:
            launches.update(record["launches"])
        if joined is not None:
            joined.append(engine.rows_joined)
        return out, engine.steps_ahead if rows_retired is None else (engine.steps_ahead, engine.rows_retired)


def same(a, b):
    """Tokens, drafts, acceptance and finish equal; the top-2 margins equal to float32 rounding. A launch ahead keeps a
    finished request's row as padding where a step-by-step engine runs fewer rows, and the CPU's BLAS may block
    another row count differently (margins 1e-6 apart were seen on the last steps of the last request running)."""
    keys = ("output_token_ids", "draft_steps", "accepted_per_position", "finish_reason")
    if [[getattr(r, k) for k in keys] for r in a] != [[getattr(r, k) for k in keys] for r in b]:
        return False
    return all(len(x.top2_margins) == len(y.top2_margins)
               and torch.allclose(torch.tensor(x.top2_margins), torch.tensor(y.top2_margins), rtol=1e-5, atol=1e-5)
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("max_num_seqs", [8, 3])  # all at once; a full batch that admits as requests finish
def test_speculative_decoding_ahead_equals_step_by_step(tiny_pair, max_num_seqs, monkeypatch):
    kept = []
    send = LLMEngine._step
    monkeypatch.setattr(LLMEngine, "_step", lambda self, step: (kept.append(getattr(step, "tables", 0) is None),
                                                                 send(self, step))[1])
    sync, ahead_sync = decode(*tiny_pair, async_decode=False, max_num_seqs=max_num_seqs)
    assert not any(kept)
    out, ahead = decode(*tiny_pair, async_decode=True, max_num_seqs=max_num_seqs)
    assert ahead_sync == 0 and ahead >= 5  # it did launch ahead
    assert sum(kept) >= 3  # launches ahead that left the tables on the device (blocks taken at admission)
    assert same(out, sync)


def test_a_windowed_draft_groups_tables_travel_whenever_its_window_slides():
    """A draft window (CacheConfig.draft_window) takes and frees the drafter's blocks as requests grow, so its tables
    change between launches ahead; a launch ahead leaves the tables on the device only when no row's changed. The
    shipped toy pair (its drafter's proposals follow their context, a random one's barely do) on HumanEval prompts:
    tokens, drafts and acceptance equal step by step (with the tables left as they were, acceptance falls by half)."""
    from qual.corpus import load_corpus
    from qual.paths import DATA_DIR
    from qual.runtime.engine import GenerationRequest
    from qual.tokenize import PromptTokenizer

    toy = DATA_DIR / "models" / "toy"
    tok = PromptTokenizer(str(toy / "target"))
    reqs = [GenerationRequest(r.id, tuple(tok.encode(r.prompt)), 24) for r in load_corpus("humaneval").requests[:8]]
    got = []
    for async_decode in (False, True):
        cfg = EngineConfig(str(toy / "target"), str(toy / "draft"),
                           cache=CacheConfig(block_size=4, memory_bytes=1 << 28, draft_window=12), dtype="float32",
                           static_shapes=True, max_model_len=400, max_num_seqs=8, async_decode=async_decode)
        with LLMEngine(cfg) as engine:
            assert engine.cache.windowed == ("draft",)
            got.append(engine.generate(reqs, SamplingParams(max_tokens=24)))
            assert engine.tables_kept == 0 or async_decode
    assert sum(sum(r.accepted_per_position) for r in got[0]) > 100
    assert same(got[1], got[0])


def test_a_finished_request_leaves_a_padding_row_and_the_run_goes_on(tiny_pair):
    """Eight requests of different lengths at once, nothing waiting: as each finishes, its row in the steps already
    launched runs for nothing and is then retired (padding: step_args.retire), and the others go on ahead."""
    sync, _ = decode(*tiny_pair, async_decode=False)
    out, (ahead, retired) = decode(*tiny_pair, async_decode=True, rows_retired=True)
    assert retired >= 3 and ahead >= 10
    assert same(out, sync)


@pytest.mark.parametrize("max_num_seqs", [8, 3])
def test_a_first_decode_step_launched_behind_its_prefill_equals_step_by_step(tiny_pair, monkeypatch, max_num_seqs):
    """The first decode step of newly admitted requests goes out before their first tokens are read, the device
    putting in the prefill's greedy choices (DecodeStep.first_rows): at the start, and (a full batch with requests
    waiting) each time one is admitted."""
    launched = []
    send = LLMEngine._step

    def spy(self, step):
        launched.extend(getattr(step, "first_rows", ()))
        return send(self, step)

    sync, _ = decode(*tiny_pair, async_decode=False, max_num_seqs=max_num_seqs)
    assert launched == []
    monkeypatch.setattr(LLMEngine, "_step", spy)
    out, _ = decode(*tiny_pair, async_decode=True, max_num_seqs=max_num_seqs)
    assert len(launched) >= (8 if max_num_seqs == 8 else 4)
    assert same(out, sync)


def test_a_first_step_refuses_prefill_rows_out_of_order(tiny_pair):
    """The first step behind a prefill takes the prefill's choices as one run of rows (the engine appends a prefill's
    requests to its batch in order); rows or picks out of that order are refused, never silently mismatched."""
    cfg = EngineConfig(str(tiny_pair[0]), str(tiny_pair[1]), cache=CacheConfig(block_size=4, memory_bytes=2**22),
                       dtype="float64", static_shapes=True, max_model_len=128, async_decode=True)
    with LLMEngine(cfg) as engine:
        runner = engine.runner
        runner.first_tokens = torch.tensor([11, 12, 13])
        step = lambda rows: DecodeStep(["a", "b", "c"], [0] * 3, [2] * 3, [0] * 3, [1] * 3, {}, first_rows=rows)  # noqa: E731
        numbers = torch.zeros(5, 4, dtype=torch.long)
        runner._amend(numbers, step([(1, 0), (2, 1)]), numbers, None)
        assert numbers[0].tolist() == [0, 11, 12, 0]
        for rows in ([(1, 1), (2, 0)], [(0, 0), (2, 1)]):
            with pytest.raises(ValueError, match="consecutive rows"):
                runner._amend(numbers, step(rows), numbers, None)


def test_the_graphs_capture_step_builds_static_arguments_on_the_cpu(tiny_pair):
    """What a CUDA graph is captured with (DecodeGraphs._dummy_step: every row padding, no blocks) makes the static
    StepArgs of its size, every row padding at the graphs' full table widths: checked on the CPU, where no graph is
    captured."""
    cfg = EngineConfig(str(tiny_pair[0]), str(tiny_pair[1]), cache=CacheConfig(block_size=4, memory_bytes=2**22),
                       dtype="float64", static_shapes=True, max_model_len=128, async_decode=True)
    with LLMEngine(cfg) as engine:
        runner = engine.runner
        step, ids = DecodeGraphs._dummy_step(SimpleNamespace(runner=runner), 4)
        args, feats = runner.step_args(step, pad_to=4, static=True)
        for rid in ids:
            runner.pending.pop(rid)
    assert args.numbers.shape == (5, 4)
    assert {name: tuple(t.shape) for name, t in args.tables.items()} == {n: (4, w) for n, w in runner.caches.max_blocks.items()}
    assert all(bool((t == -1).all()) for t in args.tables.values())
    assert feats.shape[0] == args.num_ctx == 4 * (1 + runner.K)


def test_plain_decoding_ahead_equals_step_by_step(tiny_pair):
    sync, _ = decode(tiny_pair[0], None, async_decode=False)
    out, ahead = decode(tiny_pair[0], None, async_decode=True)
    assert ahead > 10 and same(out, sync)


def test_dynamic_shapes_never_launch_ahead_and_say_so(tiny_pair):
    """The CPU's default decode (widths of each step's own): asked for, async decode is not taken, and the engine's
    record (result.json: arms.<arm>.extra.decode) says so."""
    out, ahead = decode(*tiny_pair, async_decode=True, static_shapes=False)
    sync, _ = decode(*tiny_pair, async_decode=False)
    assert ahead == 0 and same(out, sync)


def test_sampling_never_launches_ahead(tiny_pair):
    """The host draws sampled tokens (seeded noise on the CPU): the device cannot know them to advance."""
    sync, _ = decode(*tiny_pair, async_decode=False, temperature=0.8)
    out, ahead = decode(*tiny_pair, async_decode=True, temperature=0.8)
    assert ahead == 0 and same(out, sync)


def test_glm_target_with_a_dflash2_drafter_ahead_equals_step_by_step(tmp_path):
    """The GLM geometry's caches (KDA state committed at the accepted position, MLA latents, DSA pooled index keys
    and their ring) and a DFlash2 drafter with a sliding layer, advanced on the device."""
    from qual.checkpoints.dflash import DFlash2Params

    target = make_glm5(tmp_path / "glm", tiny_text())
    draft = make_draft(tmp_path / "d2", vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=8, intermediate_size=48, target_layer_ids=(0, 2), block_size=4,
                       layer_types=("sliding_attention", "full_attention"), sliding_window=3,
                       options={"dflash2": DFlash2Params(conv_kernel_size=3, conv_group_size=8, selector_rank=4,
                                                         selector_top_k=4)})
    reqs = [replace(r, max_tokens=m) for r, m in zip(prompts(5, vocab=96), (12, 5, 12, 9, 12))]
    sync, _ = decode(target, draft, async_decode=False, requests=reqs)
    out, ahead = decode(target, draft, async_decode=True, requests=reqs)
    assert ahead >= 3 and same(out, sync)


@pytest.mark.parametrize("max_num_seqs", [8, 3])
def test_launches_of_several_steps_equal_step_by_step(tiny_pair, max_num_seqs):
    """Up to four decode steps a launch (EngineConfig.steps_per_launch), each advancing the next one's inputs on the
    device, read in one copy: requests that finish inside a launch (length and EOS) keep their tokens up to the
    finish, batches change as requests are admitted, and what every request gets equals step-by-step decoding."""
    sync, _ = decode(*tiny_pair, async_decode=False, max_num_seqs=max_num_seqs)
    launches = {}
    out, _ = decode(*tiny_pair, async_decode=True, max_num_seqs=max_num_seqs, steps_per_launch=4, launches=launches)
    assert any(int(n) > 1 for n in launches), launches  # it did run several steps a launch
    assert same(out, sync)


def test_plain_launches_of_several_steps_stop_at_the_last_token(tiny_pair):
    """Plain decoding commits one token a step, so a launch runs no more steps than the longest request still needs
    (scheduler.steps_to_launch): the steps run equal the tokens generated after each prefill's first."""
    sync, _ = decode(tiny_pair[0], None, async_decode=False)
    launches = {}
    out, _ = decode(tiny_pair[0], None, async_decode=True, steps_per_launch=4, launches=launches)
    assert same(out, sync) and launches.get("4", 0) >= 3, launches
    steps = sum(int(n) * c for n, c in launches.items())
    assert steps == max(len(r.output_token_ids) for r in out) - 1  # one batch of 8, all admitted at once


def test_several_steps_a_launch_are_not_taken_without_async_decode(tiny_pair):
    """Dynamic shapes (no async decode): a step a launch, and the record says the setting was not taken."""
    launches = {}
    out, _ = decode(*tiny_pair, async_decode=True, static_shapes=False, steps_per_launch=4, launches=launches)
    assert set(launches) == {"1"}


@pytest.mark.parametrize("mode", ["spec", "plain", "sampled", "spec-4-a-launch"])
def test_requests_prefilled_ahead_and_held_ready_equal_step_by_step(tiny_pair, monkeypatch, mode):
    """EngineConfig.prefill_ahead: 8 requests of different lengths (one of a single token, finished by its prefill
    while held) on 3 rows. When rows free and none is held, one prefill takes their requests and the next ones up
    to a batch's worth, held ready; inside a run of launches ahead the next ones are prefilled behind the launch in
    flight as soon as none is held, and a held request takes a finished request's row in the next launch. Fewer
    prefill launches than a prefill a freed row, and every request's tokens, drafts and acceptance as step by step."""
    target, draft = tiny_pair[0], (None if mode == "plain" else tiny_pair[1])
    reqs = [replace(r, max_tokens=m) for r, m in zip(prompts(8), (20, 7, 1, 20, 3, 16, 9, 20))]
    kw = dict(max_num_seqs=3, requests=reqs, temperature=0.8 if mode == "sampled" else 0.0,
              steps_per_launch=4 if mode == "spec-4-a-launch" else 1)
    prefills = []
    send = LLMEngine._step

    def spy(self, step):
        if isinstance(step, PrefillStep):
            prefills.append(len(step.req_ids))
        return send(self, step)

    monkeypatch.setattr(LLMEngine, "_step", spy)
    sync, _ = decode(target, draft, async_decode=False, **kw)
    one_by_one, prefills[:] = list(prefills), []
    joined = []
    out, _ = decode(target, draft, async_decode=True, prefill_ahead=3, joined=joined, **kw)
    assert sum(prefills) == 8 and max(prefills) <= 3 and len(prefills) < len(one_by_one), (prefills, one_by_one)
    # Greedy, launched ahead: held requests take finished requests' rows inside a run (sampling never runs ahead)
    assert (joined[0] >= 2) if mode != "sampled" else joined == [0], joined
    assert same(out, sync)
