"""Each of vLLM's numeric differences alone, and all of them, on a GLM-5 toy's acceptance (docs/glm5.md, "Numerics").

    python bench/glm5_numerics.py [--model glm-toy-vllm] [--dtype float32] [--limit 164]

Runs the profile's pair at TP 1 / DCP 1 in this process (the control arm of `qual run`), greedy, on the profile's
corpus, once per numerics: exact, each piece of vLLM's alone (numerics.Numerics with one flag; `--numerics` offers
the three named forms only), vllm and vllm-hopper. Prints the acceptance rate, mean acceptance length, per-position
rates and how many requests' outputs equal exact's.
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

from qual.corpus import load_corpus
from qual.options import NUMERICS
from qual.profiles import load_profile
from qual.records import AcceptanceCounts
from qual.runtime.config import EngineConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine
from qual.runtime.models.glm5 import target as glm5_target
from qual.runtime.models.glm5.numerics import Numerics, numerics_of
from qual.tokenize import PromptTokenizer

PIECES = ("fp8_indexer", "fp8_activations", "hc_float32", "safe_gate")


def _run(profile, requests, dtype: str, numerics: Numerics):
    """Each request's result under `numerics` (the target module's numerics_of answers with it for this run, whatever
    the name the engine is configured with)."""
    cfg = EngineConfig(target_path=profile.target_path, draft_path=profile.draft_path, dtype=dtype,
                       num_speculative_tokens=profile.num_speculative_tokens, numerics=NUMERICS[1],
                       max_model_len=profile.max_model_len)
    with mock.patch.object(glm5_target, "numerics_of", lambda name: numerics), LLMEngine(cfg) as engine:
        return engine.generate(requests, SamplingParams(max_tokens=profile.max_tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="glm-toy-vllm")
    ap.add_argument("--dtype", default=None, help="default: the profile's")
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args()
    profile = load_profile(a.model)
    dtype = a.dtype or profile.dtype
    corpus = load_corpus(profile.corpus)
    tok = PromptTokenizer(profile.tokenizer_path)
    rows = corpus.requests[: a.limit] if a.limit else corpus.requests
    requests = [GenerationRequest(r.id, tuple(tok.encode(r.prompt)), profile.max_tokens, r.category) for r in rows]
    runs = [(NUMERICS[0], numerics_of(NUMERICS[0]))]
    runs += [(f"{piece} alone", Numerics(f"{piece}", **{piece: True})) for piece in PIECES]
    runs += [(name, numerics_of(name)) for name in NUMERICS[1:]]
    print(f"{a.model}, {dtype}, {len(requests)} requests of {corpus.name}, TP 1 / DCP 1, K = "
          f"{profile.num_speculative_tokens}\n")
    print("| numerics | acceptance | mean acceptance length | per position | outputs = exact's | s |\n"
          "|---|---:|---:|---|---:|---:|")
    exact = None
    for label, numerics in runs:
        t0 = time.perf_counter()
        results = _run(profile, requests, dtype, numerics)
        counts = sum((AcceptanceCounts(r.drafts, r.draft_tokens, r.accepted_tokens, list(r.accepted_per_position))
                      for r in results), AcceptanceCounts())
        outputs = [r.output_token_ids for r in results]
        exact = exact or outputs
        same = sum(a == b for a, b in zip(outputs, exact))
        per = ", ".join(f"{n / counts.drafts:.3f}" for n in counts.accepted_per_position)
        print(f"| {label} | {100 * counts.rate:.2f}% | {counts.mean_acceptance_length:.3f} | {per} | "
              f"{same}/{len(results)} | {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
