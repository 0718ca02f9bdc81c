# Fidelity probe 3: the first draft block recomputed in plain PyTorch under variant semantics, against vLLM's
# logits from probe 1 (output: fidelity_variants.log). Only "ctx k_norm of layer 0" matches vLLM.
"""Recompute the toy drafter's first block (prompt 0) in plain PyTorch under variant semantics; compare to vLLM's logits."""
import json, sys
sys.path.insert(0, "/work/main")
import torch
import torch.nn.functional as F
from qual.runtime.checkpoint import load_weights
torch.set_grad_enabled(False)
D = load_weights("/work/main/models/toy/draft"); T = load_weights("/work/main/models/toy/target")
ref = json.load(open("/tmp/lead_fid/ref.json"))
aux = torch.tensor(ref["ctx"][0]["feats"], dtype=torch.float32)  # [125, 4*256]
P = aux.shape[0]
vl = torch.load("/tmp/lead_fid/vllm_draft_logits.pt")[0]  # [7, V]
embed = T["model.embed_tokens.weight"].float(); lm = embed
H, NH, NKV, HD, EPS, THETA = 256, 8, 1, 32, 1e-6, 10000.0
def rms(x, w): return F.rms_norm(x, (x.shape[-1],), w.float(), EPS)
def rope(x, pos, neox=True):  # x [T, heads, HD]
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2).float() / HD)
    f = pos.float()[:, None] * inv[None]
    if neox:
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
        rot = torch.cat([-x[..., HD // 2:], x[..., :HD // 2]], -1)
        return x * cos + rot * sin
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
def W(name): return D[name].float()
def run(knorm_layer=None, knorm_ones=False, ctx_hidden_norm=True, ctx_knorm=True, ctx_layernorm=False, block_offset=0, drop_last_ctx=False, causal=False,
        neox=True, ctx_pos_shift=0):
    ctx = F.linear(aux, W("fc.weight"))
    if ctx_hidden_norm:
        ctx = rms(ctx, W("hidden_norm.weight"))
    cpos = torch.arange(P) + ctx_pos_shift
    block = torch.tensor([435] + [1] * 7)
    bpos = torch.arange(P, P + 8) + block_offset
    x = embed[block]
    for i in range(2):
        p = f"layers.{i}."
        h = rms(x, W(p + "input_layernorm.weight"))
        q = F.linear(h, W(p + "self_attn.q_proj.weight")).view(8, NH, HD)
        kb = F.linear(h, W(p + "self_attn.k_proj.weight")).view(8, NKV, HD)
        vb = F.linear(h, W(p + "self_attn.v_proj.weight")).view(8, NKV, HD)
        q = rope(rms(q, W(p + "self_attn.q_norm.weight")), bpos, neox)
        kb = rope(rms(kb, W(p + "self_attn.k_norm.weight")), bpos, neox)
        c = rms(ctx, W(p + "input_layernorm.weight")) if ctx_layernorm else ctx
        kc = F.linear(c, W(p + "self_attn.k_proj.weight")).view(P, NKV, HD)
        vc = F.linear(c, W(p + "self_attn.v_proj.weight")).view(P, NKV, HD)
        if ctx_knorm:
            wk = W(f"layers.{knorm_layer}.self_attn.k_norm.weight") if knorm_layer is not None else W(p + "self_attn.k_norm.weight")
            kc = rms(kc, torch.ones_like(wk) if knorm_ones else wk)
        kc = rope(kc, cpos, neox)
        if drop_last_ctx:
            kc, vc = kc[:-1], vc[:-1]
        k = torch.cat([kc, kb]); v = torch.cat([vc, vb])  # [S, 1, HD]
        s = torch.einsum("thd,sd->hts", q, k[:, 0]) * HD ** -0.5
        if causal:
            S = k.shape[0]; mask = torch.ones(8, S, dtype=torch.bool); mask[:, S - 8:] = torch.ones(8, 8).tril().bool()
            s = s.masked_fill(~mask[None], float("-inf"))
        o = torch.einsum("hts,sd->thd", s.softmax(-1), v[:, 0]).reshape(8, NH * HD)
        x = x + F.linear(o, W(p + "self_attn.o_proj.weight"))
        h = rms(x, W(p + "post_attention_layernorm.weight"))
        x = x + F.linear(F.silu(F.linear(h, W(p + "mlp.gate_proj.weight"))) * F.linear(h, W(p + "mlp.up_proj.weight")),
                         W(p + "mlp.down_proj.weight"))
    return F.linear(rms(x, W("norm.weight")), lm)[1:]
variants = {"ctx k_norm of layer 0": dict(knorm_layer=0), "ctx k_norm of layer 1": dict(knorm_layer=1),
            "ctx k_norm weight ones": dict(knorm_ones=True), "ours": {}, "no ctx k_norm": dict(ctx_knorm=False), "no hidden_norm": dict(ctx_hidden_norm=False),
            "ctx input_layernorm": dict(ctx_layernorm=True), "block +1": dict(block_offset=1), "block -1": dict(block_offset=-1),
            "drop last ctx": dict(drop_last_ctx=True), "causal": dict(causal=True), "interleaved rope": dict(neox=False),
            "ctx pos +1": dict(ctx_pos_shift=1)}
for name, kw in variants.items():
    lg = run(**kw)
    d = (lg - vl).abs().max().item()
    print(f"{name:22s} max |logit - vLLM| {d:8.4f}  pos1 top {lg[0].argmax().item()} ({lg[0].max().item():.3f})  pos2 {lg[1].max().item():.3f}")
print("vLLM pos1", vl[0].argmax().item(), vl[0].max().item())
