"""A compiled PyTorch peer for bench/gpu_bench.py's decode rows: the same checkpoint decoded the way gpt-fast does it.

gpt-fast (pytorch-labs) decodes a Llama-style model with plain PyTorch modules, a static KV cache written in place
(`index_copy_`), attention by `scaled_dot_product_attention` over the cache's whole width with a boolean mask, and
one decode step compiled with `torch.compile(mode="reduce-overhead", fullgraph=True)` (inductor's kernels replayed
from its own CUDA graph), the prefill run eagerly. This module is that recipe written for the Qwen3 layout the
benchmark's shapes use (per-head q/k RMSNorm, rotate-half RoPE, SwiGLU, untied or tied LM head), greedy decoding,
every row of a batch at the same position (the benchmark's prompts have one length). Not qual's runtime: a peer
measured in the same process on the same weights, so that a row's bandwidth share has a reference beside it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from qual.checkpoints.qwen3 import Qwen3Config


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * w


class PeerModel(torch.nn.Module):
    """The checkpoint's decoder with a static KV cache of `batch` rows x `max_len` positions."""

    def __init__(self, path: Path, cfg: Qwen3Config, batch: int, max_len: int, device: str = "cuda"):
        super().__init__()
        w = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            w.update(load_file(str(f), device=device))
        self.cfg, self.eps = cfg, cfg.rms_norm_eps
        H, Hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # Buffers, as gpt-fast's weights and caches are module state: the compiled step's CUDA graph reads them in
        # place (static addresses) rather than copying them in before each replay
        self.register_buffer("embed", w["model.embed_tokens.weight"])
        self.register_buffer("lm_head", self.embed if cfg.tie_word_embeddings else w["lm_head.weight"])
        self.register_buffer("norm", w["model.norm.weight"])
        dt = self.embed.dtype
        self.layers = torch.nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            p, lay = f"model.layers.{i}.", torch.nn.Module()
            for name, t in {
                    "ln1": w[p + "input_layernorm.weight"], "ln2": w[p + "post_attention_layernorm.weight"],
                    "wqkv": torch.cat([w.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                    "qn": w[p + "self_attn.q_norm.weight"], "kn": w[p + "self_attn.k_norm.weight"],
                    "wo": w[p + "self_attn.o_proj.weight"],
                    "w13": torch.cat([w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")]),
                    "w2": w[p + "mlp.down_proj.weight"],
                    "k_cache": torch.zeros(batch, Hk, max_len, D, device=device, dtype=dt),
                    "v_cache": torch.zeros(batch, Hk, max_len, D, device=device, dtype=dt)}.items():
                lay.register_buffer(name, t)
            self.layers.append(lay)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
        ang = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", torch.cat([ang.cos(), ang.cos()], -1).to(dt))  # [max_len, D]
        self.register_buffer("sin", torch.cat([ang.sin(), ang.sin()], -1).to(dt))
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=device)))
        self.H, self.Hk, self.D = H, Hk, D

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]  # [1, 1, T, D]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] at positions pos [T] -> logits of the last position [B, vocab]."""
        B, T = tokens.shape
        H, Hk, D = self.H, self.Hk, self.D
        x = F.embedding(tokens, self.embed)
        mask = self.causal[pos][None, None]  # [1, 1, T, max_len]
        for lay in self.layers:
            h = _rms(x, lay.ln1, self.eps)
            q, k, v = F.linear(h, lay.wqkv).split([H * D, Hk * D, Hk * D], dim=-1)
            q = self._rope(_rms(q.view(B, T, H, D), lay.qn, self.eps).transpose(1, 2), pos)
            k = self._rope(_rms(k.view(B, T, Hk, D), lay.kn, self.eps).transpose(1, 2), pos)
            lay.k_cache.index_copy_(2, pos, k)
            lay.v_cache.index_copy_(2, pos, v.view(B, T, Hk, D).transpose(1, 2))
            y = F.scaled_dot_product_attention(q, lay.k_cache, lay.v_cache, attn_mask=mask, enable_gqa=True)
            x = x + F.linear(y.transpose(1, 2).reshape(B, T, H * D), lay.wo)
            gate, up = F.linear(_rms(x, lay.ln2, self.eps), lay.w13).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lay.w2)
        return F.linear(_rms(x[:, -1], self.norm, self.eps), self.lm_head)


def peer_decode(path: Path, cfg: Qwen3Config, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Greedy decoding of `batch` random prompts of prompt_len tokens for new_tokens tokens: the prefill eager, each
    decode step compiled (reduce-overhead); a warm-up generate (compiles and records), then a timed one."""
    model = PeerModel(path, cfg, batch, prompt_len + new_tokens)
    # gpt-fast's decode_one_token: the step and its greedy choice in one compiled graph
    step = torch.compile(lambda tok, pos: model(tok, pos).argmax(-1, keepdim=True), mode="reduce-overhead",
                         fullgraph=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size - 2, (batch, prompt_len), generator=g).cuda()

    def generate() -> torch.Tensor:
        with torch.no_grad():
            tok = model(prompt, torch.arange(prompt_len, device="cuda")).argmax(-1, keepdim=True)
            out = [tok]
            for t in range(prompt_len, prompt_len + new_tokens - 1):
                tok = step(tok, torch.tensor([t], device="cuda")).clone()  # the graph's output is overwritten next step
                out.append(tok)
            return torch.cat(out, 1)

    t = time.perf_counter()
    generate()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    generate()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    del model, step
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return {"tokens_per_s": batch * new_tokens / wall, "wall_s": wall, "first_generate_s": compile_s}
