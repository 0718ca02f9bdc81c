"""The GLM-5.3-Flash reference forward against transformers (an implementation we did not write).

float64 throughout, with transformers' float32 islands raised to float64 (glm5_checkpoints.float64_islands),
so logits must agree to 1e-9; one test compares float32 against the unmodified transformers.
"""

import dataclasses

import pytest
import torch

from glm5_checkpoints import float64_islands, make_glm5, oracle, oracle_forward, single_thread, tiny_text  # noqa: F401

from glm5_unpaged import Glm5Reference

F64 = torch.float64
KDA, MLA = "linear_attention", "indexed_attention"

CONFIGS = {
    # transformers' default schedules: KDA, KDA, KDA, MLA (full indexer); dense, dense, dense, MoE; 4 streams
    "default": dict(text=tiny_text()),
    # shared indexer layers after full ones, MoE everywhere, one stream, softplus decay, tied lm_head
    "shared": dict(text=tiny_text(num_hidden_layers=6, layer_types=[KDA, "full_attention", MLA, KDA, MLA, MLA],
                                  indexer_types=["full", "full", "shared", "full", "full", "shared"],
                                  mlp_layer_types=["sparse"] * 6, hc_mult=1, linear_lower_bound=None,
                                  n_shared_experts=2, norm_topk_prob=False), tie=True),
    # a bare Glm5NextTextModel (no lm_head: final hidden states compared), dense MLPs only
    "text": dict(text=tiny_text(layer_types=[KDA, MLA, KDA, MLA], mlp_layer_types=["dense"] * 4), composite=False),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5")
    return {name: make_glm5(root / name, **kw, seed=i) for i, (name, kw) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def oracles(ckpts):
    return {name: oracle(path) for name, path in ckpts.items()}


def _ids(n, seed):
    return torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(seed))


def _out(o):
    return o.logits if o.logits is not None else o.hidden


def _check_sparse(outs, min_margin=1e-6):
    """Selection really dropped keys, and no selection boundary was a near tie (the oracle's top-k order
    of equal scores is unspecified)."""
    dropped = any((m.sum(-1) < torch.arange(m.shape[1] - m.shape[0], m.shape[1]) + 1).any()
                  for o in outs for ms in o.attended.values() for m in ms)
    assert dropped
    assert min(o.select_margin for o in outs) > min_margin


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_pieces_and_decode_match_transformers(ckpts, oracles, name):
    ids = _ids(90, 1)
    want = oracle_forward(oracles[name], ids)
    # pieces of 37, 30, 13 tokens with 16-token KDA chunks: pieces and chunks both cross each other
    ref = Glm5Reference.load(ckpts[name], dtype=F64, kda_chunk=16)
    req, outs, s = ref.new_request(), [], 0
    for k in (37, 30, 13):
        outs.append(ref.prefill(req, ids[s:s + k]))
        s += k
    while s < 90:
        outs.append(ref.decode([req], ids[s:s + 1]))
        s += 1
    got = torch.cat([_out(o)[0] for o in outs])
    assert (got - want).abs().max() < 1e-9
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    _check_sparse(outs)
    # one 90-token prefill with 64-token chunks (the chunk boundary inside the prompt)
    whole = Glm5Reference.load(ckpts[name], dtype=F64).prefill(ref.new_request(), ids)
    assert (_out(whole)[0] - want).abs().max() < 1e-9


def test_greedy_generation_matches_transformers(ckpts, oracles):
    prompt = _ids(21, 2)
    with torch.no_grad(), float64_islands():
        gen = oracles["default"].generate(prompt[None], max_new_tokens=8, do_sample=False, eos_token_id=None,
                                          pad_token_id=0, attention_mask=torch.ones(1, 21, dtype=torch.long))
    ref = Glm5Reference.load(ckpts["default"], dtype=F64)
    req = ref.new_request()
    tok = ref.prefill(req, prompt).logits[0, -1].argmax()
    ours = [tok.item()]
    for _ in range(7):
        tok = ref.decode([req], tok.reshape(1)).logits[0, -1].argmax()
        ours.append(tok.item())
    assert ours == gen[0, 21:].tolist()


@pytest.mark.parametrize("name", ["default", "shared"])
def test_verify_commit_and_redo_match_transformers(ckpts, oracles, name):
    """Two requests verify 4 tokens at once; committing a prefix and verifying again equals the full forward.

    Request 0 has 33 committed tokens: its 3rd draft (position 35) completes pool 8 and is rejected, so the redo
    recompresses that pool from the tail ring."""
    ref = Glm5Reference.load(ckpts[name], dtype=F64, num_speculative_tokens=3, aux_layer_ids=(0, 2))
    prompts, reqs = [_ids(33, 3), _ids(29, 4)], [ref.new_request(), ref.new_request()]
    for req, p in zip(reqs, prompts):
        ref.prefill(req, p)
    seqs = [p.clone() for p in prompts]
    outs = []
    for step, accepted in enumerate(([2, 4], [3, 1], [1, 2])):
        drafts = torch.stack([_ids(4, 10 + 2 * step), _ids(4, 11 + 2 * step)])
        out, pending = ref.verify(reqs, drafts)
        outs.append(out)
        for r in range(2):
            full = torch.cat([seqs[r], drafts[r]])
            want = oracle_forward(oracles[name], full)[-4:]
            assert (_out(out)[r] - want).abs().max() < 1e-9
            seqs[r] = torch.cat([seqs[r], drafts[r, :accepted[r]]])
        ref.commit(reqs, pending, accepted)
        assert [req.length for req in reqs] == [s.numel() for s in seqs]
    _check_sparse(outs)
    # aux hidden states: the stream mean after layers 0 and 2 (transformers records each layer's input)
    with torch.no_grad(), float64_islands():
        hs = oracles[name](input_ids=seqs[1][None], output_hidden_states=True).hidden_states
    aux = torch.cat([hs[1][0, -4:].mean(1), hs[3][0, -4:].mean(1)], -1)
    # the last verify's rows: request 1 accepted 2 of them
    assert (outs[-1].aux[1, :2] - aux[-2:]).abs().max() < 1e-9


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_sum_to_tp1(ckpts, tp):
    for name in ("default", "shared"):
        ids, drafts = _ids(41, 5), _ids(3, 6).reshape(1, 3)
        results = []
        for size in (1, tp):
            ref = Glm5Reference.load(ckpts[name], tp_size=size, dtype=F64, num_speculative_tokens=2)
            req = ref.new_request()
            first = _out(ref.prefill(req, ids))
            results.append(torch.cat([first[0], _out(ref.verify([req], drafts)[0])[0]]))
        assert (results[0] - results[1]).abs().max() < 1e-12


def test_float32_matches_unmodified_transformers(ckpts):
    """No float64 islands: float32 against transformers as shipped (its float32 casts are no-ops here)."""
    from transformers import Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(str(ckpts["default"]), dtype=torch.float32,
                                                             attn_implementation="eager", experts_implementation="eager")
    ids = _ids(70, 7)
    want = oracle_forward(model.eval(), ids, islands64=False)
    ref = Glm5Reference.load(ckpts["default"], dtype=torch.float32)
    got = ref.prefill(ref.new_request(), ids).logits[0]
    assert got.dtype == torch.float32
    exact = Glm5Reference.load(ckpts["default"], dtype=F64)
    assert exact.prefill(exact.new_request(), ids).select_margin > 1e-4  # float32 noise cannot flip a selection
    assert (got - want).abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_swiglu_clamps_are_exercised(ckpts):
    """The configs above compare with clamps that bite: lifting the limit changes the logits."""
    ids = _ids(30, 8)
    ref = Glm5Reference.load(ckpts["default"], dtype=F64)
    clamped = ref.prefill(ref.new_request(), ids).logits
    ref.cfg = dataclasses.replace(ref.cfg, swiglu_limit=1e9)
    free = ref.prefill(ref.new_request(), ids).logits
    assert (clamped - free).abs().max() > 1e-3
