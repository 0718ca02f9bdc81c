"""Stage 5: the target's own greedy continuations of prompts cut from held-in code (drafter data)."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from qual.toy.config import TrainConfig


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [B, P] (no padding) -> [B, P + new_tokens], greedy with a KV cache; EOS does not stop a row."""
    from transformers import DynamicCache

    # A cache built from the text config holds what the architecture needs (GLM-5: KDA states, index keys too).
    out = model(input_ids=prompts, past_key_values=DynamicCache(config=model.config.get_text_config()), use_cache=True,
                logits_to_keep=1)
    tokens = [prompts, out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(new_tokens - 1):
        out = model(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


def docstring_cut_points(stream: np.ndarray, tokenizer) -> np.ndarray:
    """Stream offsets just after a `\"\"\"` token followed by a newline token (a docstring opens or closes).

    A HumanEval prompt ends exactly there, so prompts cut at these points teach
    the drafter what the target writes after a docstring.
    """
    text = [tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())]
    quotes = np.array([t.strip() == '"""' for t in text])
    newline = np.array([t.startswith("\n") for t in text])
    s = stream.astype(np.int64)
    return np.nonzero(quotes[s[:-1]] & newline[s[1:]])[0] + 2


def generate_dataset(model, train_tokens: np.ndarray, tokenizer, cfg: TrainConfig, device: str,
                     log: Callable[[str], None]) -> dict:
    """{"chunks": [[rows, P + gen_new_tokens] int32], "prompt_lens": [P per chunk]}.

    Each chunk has one prompt length (cycling over cfg.prompt_lens); a fraction
    cfg.docstring_prompt_frac of its prompts end at docstring quotes, the rest at
    random offsets.
    """
    rng = np.random.default_rng(cfg.seed + 1)
    cuts = docstring_cut_points(train_tokens, tokenizer)
    stream = torch.from_numpy(train_tokens.astype(np.int64))
    chunks, plens, t0 = [], [], time.time()
    n_batches = -(-cfg.num_prompts // cfg.gen_batch)
    for i in range(n_batches):
        b = min(cfg.gen_batch, cfg.num_prompts - i * cfg.gen_batch)
        p = cfg.prompt_lens[i % len(cfg.prompt_lens)]
        n_doc = int(round(b * cfg.docstring_prompt_frac)) if len(cuts) else 0
        ends = np.concatenate([
            rng.choice(cuts[cuts >= p], size=n_doc) if n_doc else np.zeros(0, dtype=np.int64),
            rng.integers(p, len(train_tokens), size=b - n_doc),
        ])
        starts = torch.from_numpy(ends - p)
        prompts = stream[starts[:, None] + torch.arange(p)].to(device)
        chunks.append(greedy_continue(model, prompts, cfg.gen_new_tokens).to("cpu", torch.int32))
        plens.append(p)
        log(f"generate batch {i + 1}/{n_batches} prompt_len {p} ({time.time() - t0:.0f}s)")
    return {"chunks": chunks, "prompt_lens": plens}
