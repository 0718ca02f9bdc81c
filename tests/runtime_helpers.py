"""Shared by the runtime tests: a batch of prompts and a one-call engine run."""

import torch

from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine


def prompts(n=5, vocab=90, seed=3, max_tokens=20):
    """n random prompts of fixed lengths. Each request carries its own max_tokens, which wins over the
    SamplingParams' (as a corpus request's does): pass the length a test means here."""
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 40, 9, 26, 11, 5, 31][:n]
    return [GenerationRequest(f"r{i}", tuple(torch.randint(0, vocab, (L,), generator=g).tolist()), max_tokens)
            for i, L in enumerate(lens)]


def run(target, draft, tp=1, dcp=1, interleave=1, draft_kv="replicated", dtype="float64", temperature=0.0,
        requests=None, logits=False, block_size=4, dcp_comm="a2a", **kw):
    cfg = EngineConfig(str(target), str(draft) if draft else None, ParallelConfig(tp, dcp, interleave, dcp_comm),
                       CacheConfig(block_size=block_size, memory_bytes=2**22), draft_kv=draft_kv, dtype=dtype, **kw)
    reqs = requests or prompts()
    with LLMEngine(cfg) as engine:
        out = engine.generate(reqs, SamplingParams(temperature=temperature, seed=7, max_tokens=20))
        lg = engine.prompt_logits([list(r.prompt_token_ids) for r in reqs]) if logits else None
    assert [p.exitcode for p in engine.workers] == [0] * (engine.cfg.parallel.world_size - 1)  # clean exits, no abort
    return out, lg
