import sys, torch
sys.path.insert(0, '/work/main')
import qual.runtime.models.dflash as dm
from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine
from qual.corpus import load_corpus
from qual.tokenize import PromptTokenizer
mode = sys.argv[1]
if mode == "causal":
    orig = dm.DFlashDrafter.__init__
    def init(self, *a, **k):
        orig(self, *a, **k)
        self.block_masks["full_attention"] = self.block_masks["full_attention"].tril()
    dm.DFlashDrafter.__init__ = init
tok = PromptTokenizer('models/toy/target')
reqs = [GenerationRequest(r.id, tuple(tok.encode(r.prompt)), 64) for r in load_corpus('humaneval').requests[:64]]
cfg = EngineConfig('models/toy/target', 'models/toy/draft', ParallelConfig(1, 1, 1), CacheConfig(block_size=16))
with LLMEngine(cfg) as e:
    out = e.generate(reqs, SamplingParams(max_tokens=64))
acc = sum(r.accepted_tokens for r in out); dr = sum(r.draft_tokens for r in out)
pos = [sum(r.accepted_per_position[i] for r in out) / sum(r.drafts for r in out) for i in range(7)]
print(mode, f"rate {acc/dr:.4f}", "pos1..7", [round(p, 3) for p in pos], "drafts", sum(r.drafts for r in out))
