# Fidelity probe 2 (the qual venv): the embedded runtime on the same prompt; records context features and proposals.
import json, sys
sys.path.insert(0, "/work/main")
import torch
from qual.runtime.config import CacheConfig, EngineConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine
from qual.runtime.models import dflash
from qual.runtime import model_runner as mr

ctx, steps = [], []
orig_wc = dflash.DFlashDrafter.write_context
def write_context(self, feats, positions, *a, **kw):
    ctx.append({"positions": positions.tolist(), "feats": feats.float().tolist()})
    return orig_wc(self, feats, positions, *a, **kw)
dflash.DFlashDrafter.write_context = write_context
orig_ex = mr.ModelRunner.execute
def execute(self, step):
    out = orig_ex(self, step)
    if out is not None and out.draft_tokens is not None:
        steps.append({"drafts": out.draft_tokens.tolist(), "last": list(step.last_tokens)})
    return out
mr.ModelRunner.execute = execute
ids = json.load(open("/tmp/lead_fid/prompt.json"))
cfg = EngineConfig("/work/main/models/toy/target", "/work/main/models/toy/draft", dtype="float32",
                   cache=CacheConfig(block_size=16, memory_bytes=64 << 20))
with LLMEngine(cfg) as e:
    out = e.generate([GenerationRequest("r", tuple(ids), 24)], SamplingParams(max_tokens=24, ignore_eos=True))
print("OUT", out[0].output_token_ids)
json.dump({"out": out[0].output_token_ids, "ctx": ctx, "steps": steps}, open("/tmp/lead_fid/ref.json", "w"))
