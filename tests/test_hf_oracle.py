"""Greedy tokens equal Hugging Face transformers' generate on the same checkpoint (an oracle we did not write)."""

import pytest
import torch

from runtime_helpers import prompts, run

transformers = pytest.importorskip("transformers")


def hf_greedy(target, reqs, max_new_tokens=20):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float64, attn_implementation="eager")
    model.eval()
    outs = []
    for r in reqs:
        ids = torch.tensor([r.prompt_token_ids])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 attention_mask=torch.ones_like(ids))
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def test_greedy_matches_transformers(tiny_pair):
    reqs = prompts()
    want = hf_greedy(tiny_pair[0], reqs)
    plain, _ = run(tiny_pair[0], None, requests=reqs)
    spec, _ = run(*tiny_pair, requests=reqs)
    trim = lambda rs: [r.output_token_ids for r in rs]  # noqa: E731
    # our runs stop at EOS; compare up to each of our lengths
    assert sum(len(r.output_token_ids) for r in plain) >= 3 * len(reqs)
    for ours_plain, ours_spec, theirs in zip(trim(plain), trim(spec), want):
        assert ours_plain == theirs[: len(ours_plain)]
        assert ours_spec == ours_plain


def test_dcp4_matches_transformers(tiny_pair):
    reqs = prompts(3)
    want = hf_greedy(tiny_pair[0], reqs)
    out, _ = run(*tiny_pair, tp=4, dcp=4, requests=reqs)
    for ours, theirs in zip(out, want):
        assert ours.output_token_ids == theirs[: len(ours.output_token_ids)]
