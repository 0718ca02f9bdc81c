"""bench/compiled_peer.py: the gpt-fast-style peer of gpu_bench's decode rows decodes what transformers does."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
compiled_peer = pytest.importorskip("compiled_peer")


@pytest.mark.parametrize("over", [{}, {"tie_word_embeddings": True, "num_key_value_heads": 2}])
def test_the_peer_gives_transformers_logits_from_its_static_cache(tmp_path, over):
    """A prompt's prefill, then one token a step from the static KV cache, in float32 on the CPU: each position's
    logits are transformers' for the whole sequence (untied and tied LM heads, 1 and 2 KV heads)."""
    from transformers import AutoModelForCausalLM

    from checkpoints import make_target
    from qual.checkpoints.qwen3 import read_qwen3

    path = make_target(tmp_path / "t", **over)
    peer = compiled_peer.PeerModel(path, read_qwen3(path), batch=2, max_len=16, device="cpu")
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = ref(tokens).logits
        got = [peer(tokens[:, :8], torch.arange(8))] + [peer(tokens[:, t:t + 1], torch.tensor([t])) for t in (8, 9, 10)]
    for t, logits in zip((7, 8, 9, 10), got):
        torch.testing.assert_close(logits, exact[:, t], rtol=1e-5, atol=1e-4)
