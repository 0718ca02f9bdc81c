"""An independent recomputation of one DFlash / DFlash2 draft step, written from vLLM's qwen3_dflash.py,
qwen3_dflash2.py and its DFlash2 speculator, for tests: plain PyTorch over the safetensors tensors and the raw
config.json, one request at a time, the whole sequence in position order, attention with an explicit mask, loops
where vLLM has kernels. It shares no code with qual.runtime.

The target's aux hidden states come from transformers (hidden_states[i + 1] = output of decoder layer i).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def rms(x, w, eps):
    x64 = x.to(torch.float64)
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta, neox):
    """x [T, heads, D] rotated by integer positions [T] (vLLM's forward_native layout rules)."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = pos.to(torch.float64)[:, None] * inv  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = (x[..., : D // 2], x[..., D // 2 :]) if neox else (x[..., 0::2], x[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat([o1, o2], -1) if neox else torch.stack([o1, o2], -1).flatten(-2)


def visible(p: int, k: int, first_block: int, window, causal: bool) -> bool:
    """Whether the query at position p sees the key at position k (context keys sit before first_block)."""
    if window is not None and abs(p - k) >= window:
        return False
    return k < first_block or not causal or k <= p


def grouped_conv(x, delta, base, groups):
    """vLLM's CPU `_grouped_conv` for one block, as loops: out[r] = sum_{t <= r} (base[t] + delta[r, t, group]) x[r - t]."""
    N, H = x.shape
    g = H // groups
    out = torch.zeros_like(x)
    for r in range(N):
        for t in range(base.shape[0]):
            if r >= t:
                out[r] += (base[t] + delta[r, t].repeat_interleave(g)) * x[r - t]
    return out


class ReferenceDrafter:
    def __init__(self, target_dir: Path, draft_dir: Path):
        from transformers import AutoModelForCausalLM

        self.cfg = json.loads((Path(draft_dir) / "config.json").read_text())
        self.w = {k: v.to(torch.float64) for k, v in load_file(str(Path(draft_dir) / "model.safetensors")).items()}
        tw = load_file(str(Path(target_dir) / "model.safetensors"))
        self.embed = self.w.get("embed_tokens.weight", tw["model.embed_tokens.weight"].to(torch.float64))
        self.lm_head = self.w.get("lm_head.weight", tw["lm_head.weight"].to(torch.float64))
        mask_file = Path(draft_dir) / "mask_embedding.pt"
        self.mask_embedding = None
        if mask_file.exists():  # DFlashQwen3ForCausalLM._read_mask_embedding: a tensor or {"embedding": ...}
            state = torch.load(mask_file)
            self.mask_embedding = (state["embedding"] if isinstance(state, dict) else state).to(torch.float64).reshape(-1)
        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64, attn_implementation="eager").eval()
        c, d = self.cfg, self.cfg["dflash_config"]
        self.dflash2 = "DFlash2DraftModel" in c["architectures"]
        self.ids = d["target_layer_ids"]
        self.mask_id = d["mask_token_id"]
        self.eps = c["rms_norm_eps"]
        self.heads, self.kv, self.D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.theta = c["rope_theta"]
        self.neox = c.get("is_neox_style", True)
        self.vscale = d.get("attention_value_scale")
        types = c["layer_types"]
        window = d.get("swa_window_size", c["sliding_window"] if c.get("use_sliding_window") else None)
        any_sliding = "sliding_attention" in types
        self.layers = []
        for i, t in enumerate(types):  # qwen3_dflash._resolve_layer_attention
            sliding = d.get("use_swa", False) if (d.get("use_swa", False) and not any_sliding) else t == "sliding_attention"
            causal = c.get("is_causal")
            causal = d.get("causal") if causal is None else causal
            causal = (t == "sliding_attention") if causal is None else causal
            self.layers.append((window if sliding else None, bool(causal)))

    def aux(self, tokens: list[int]) -> torch.Tensor:
        """Each target layer's output (the residual stream after it; for the last layer, before the final norm,
        which transformers' hidden_states[-1] has applied), in ascending layer order as vLLM concatenates them."""
        outputs, hooks = {}, []
        for i in set(self.ids):
            capture = lambda module, args, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)  # noqa: E731
            hooks.append(self.model.model.layers[i].register_forward_hook(capture))
        try:
            with torch.no_grad():
                self.model(torch.tensor([tokens]))
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([outputs[i][0] for i in sorted(self.ids)], -1)

    def step(self, aux: torch.Tensor, tokens: list[int], n: int, K: int) -> list[int]:
        """The K proposals of the draft step taken with n committed tokens (tokens[n - 1] is the anchor)."""
        w, eps, H, Hk, D = self.w, self.eps, self.heads, self.kv, self.D
        ctx = rms(aux[: n - 1] @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # context: positions 0 .. n-2
        block = [tokens[n - 1]] + [self.mask_id] * K
        x = self.embed[torch.tensor(block)]
        if self.mask_embedding is not None:
            x[torch.tensor(block) == self.mask_id] = self.mask_embedding
        if self.dflash2:
            x = x * self.cfg["dflash_config"].get("input_embedding_scale", 1.0)
        first = n - 1
        ctx_pos, blk_pos = torch.arange(first), torch.arange(first, first + K + 1)
        all_pos = torch.cat([ctx_pos, blk_pos])
        for i, (window, causal) in enumerate(self.layers):
            p = f"layers.{i}."
            b = lambda name: w.get(p + name + ".bias")  # noqa: E731
            lin = lambda t, name: t @ w[p + name + ".weight"].T + (0 if b(name) is None else b(name))  # noqa: E731

            def attend(h):
                q = rms(lin(h, "self_attn.q_proj").view(-1, H, D), w[p + "self_attn.q_norm.weight"], eps)
                k = torch.cat([lin(ctx, "self_attn.k_proj"), lin(h, "self_attn.k_proj")]).view(-1, Hk, D)
                v = torch.cat([lin(ctx, "self_attn.v_proj"), lin(h, "self_attn.v_proj")]).view(-1, Hk, D)
                k = rope(rms(k, w[p + "self_attn.k_norm.weight"], eps), all_pos, self.theta, self.neox)
                q = rope(q, blk_pos, self.theta, self.neox)
                if self.vscale is not None:
                    v = v * self.vscale
                mask = torch.tensor([[visible(int(qp), int(kp), first, window, causal) for kp in all_pos] for qp in blk_pos])
                sink = w.get(p + "self_attn.attention_sink_bias")
                out = torch.zeros(K + 1, H, D, dtype=torch.float64)
                for hh in range(H):
                    s = (q[:, hh] @ k[:, hh // (H // Hk)].T) * D**-0.5
                    s = s.masked_fill(~mask, float("-inf"))
                    if sink is not None:  # one more logit per row, carrying no value
                        s = torch.cat([s, sink[hh].expand(K + 1, 1)], 1)
                    prob = torch.softmax(s, -1)[:, : k.shape[0]]
                    out[:, hh] = prob @ v[:, hh // (H // Hk)]
                return lin(out.reshape(K + 1, H * D), "self_attn.o_proj")

            def mix(h):
                g, u = lin(h, "mlp.gate_proj"), lin(h, "mlp.up_proj")
                return lin(torch.nn.functional.silu(g) * u, "mlp.down_proj")

            for norm, inner, conv in (("input_layernorm", attend, "attention_conv"), ("post_attention_layernorm", mix, "mlp_conv")):
                h = rms(x, w[p + norm + ".weight"], eps)
                if self.dflash2:  # DFlash2GroupedConv: prepare, inner, finish
                    base = w[p + conv + ".base_kernel"]
                    taps, groups = base.shape[1], w[p + conv + ".kernel_projection.weight"].shape[0] // (2 * base.shape[1])
                    coef = (h @ w[p + conv + ".kernel_projection.weight"].T).view(K + 1, 2, taps, groups)
                    y = inner(grouped_conv(h, coef[:, 0], base[0], groups))
                    x = x + grouped_conv(y, coef[:, 1], base[1], groups)
                else:
                    x = x + inner(h)
        hid = rms(x, w["norm.weight"], eps)[1:]  # the K mask positions
        logits = hid @ self.lm_head.T
        if not self.dflash2:
            return logits.argmax(-1).tolist()
        return self._walk(logits, hid, tokens[n - 1])

    def _walk(self, logits, hid, anchor: int) -> list[int]:
        """DFlash2Qwen3ForCausalLM.compute_candidates, _score_edges and the selector walk at temperature 0."""
        d, w = self.cfg["dflash_config"], self.w
        k = d["selector_top_k"]
        values, cand = torch.topk(logits, k, dim=-1)
        values = values * d.get("output_multiplier", 1.0)
        cap = float(d.get("final_logit_softcapping") or 0.0)
        if cap > 0:
            values = torch.tanh(values / cap) * cap
        proj = hid @ w["candidate_selector.hidden_projection.weight"].T
        pred, succ = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
        out, prev_token = [], anchor
        for step in range(logits.shape[0]):
            scores = [values[step, c] + (pred[prev_token] * proj[step] * succ[cand[step, c]]).sum() for c in range(k)]
            best = max(range(k), key=lambda c: (scores[c], -c))  # first of equals
            prev_token = int(cand[step, best])
            out.append(prev_token)
        return out


def check_draft_steps(target_dir, draft_dir, results, K: int) -> int:
    """Assert every recorded draft step's proposals equal the reference's; returns how many steps were checked."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add synchronisation
    try:
        ref = ReferenceDrafter(target_dir, draft_dir)
        checked = 0
        for r in results:
            tokens = list(r.prompt_token_ids) + list(r.output_token_ids)
            aux = ref.aux(tokens)  # causal target: the prefix's states are the full sequence's
            for n, proposals in r.draft_steps:
                assert ref.step(aux, tokens, n, K) == proposals, (r.id, n)
                checked += 1
        return checked
    finally:
        torch.set_num_threads(threads)
