"""Stage 4: the Qwen3 target (transformers' Qwen3ForCausalLM) trained as a next-token LM on code."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from qual.toy.config import ModelShape, TrainConfig
from qual.toy.tokenizer import TOKENIZER_FILES


def target_config(shape: ModelShape, eos_token_id: int):
    """The HF Qwen3 config of the toy target."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        hidden_act="silu",
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


def build_target(shape: ModelShape, eos_token_id: int, seed: int):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(target_config(shape, eos_token_id))


def lr_at(step: int, base_lr: float, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10% of the base rate."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, device: str):
    """AdamW; no decay on norms (1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.startswith("cuda"))


def sample_windows(tokens: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, length] random windows of the token stream."""
    starts = torch.randint(0, tokens.numel() - length, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(length)
    return tokens[idx.to(tokens.device)]


def autocast(device: str):
    """bf16 autocast on GPU; plain float32 on CPU (keeps the CPU test exact and simple)."""
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def eval_loss(model, tokens: torch.Tensor, length: int, max_windows: int, device: str) -> float:
    """Mean next-token loss over non-overlapping windows of a held-out stream."""
    model.eval()
    n = min(max_windows, max(1, (tokens.numel() - 1) // length))
    windows = tokens[: n * length].view(n, length)
    losses = []
    for chunk in windows.split(16):
        with autocast(device):
            losses.append(model(input_ids=chunk, labels=chunk).loss.float().item())
    model.train()
    return float(np.mean(losses))


def train_target(cfg: TrainConfig, train_tokens: np.ndarray, val_tokens: np.ndarray, eos_token_id: int,
                 device: str, log: Callable[[str], None]):
    """Train the target; returns (model in float32, stats dict)."""
    model = build_target(cfg.shape, eos_token_id, cfg.seed).to(device)
    model.train()
    train_t = torch.from_numpy(train_tokens.astype(np.int64)).to(device)
    val_t = torch.from_numpy(val_tokens.astype(np.int64)).to(device)
    opt = make_optimizer(model, cfg.target_lr, cfg.weight_decay, device)
    gen = torch.Generator().manual_seed(cfg.seed)
    t0, curve = time.time(), []
    loss_avg = None
    for step in range(cfg.target_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.target_lr, cfg.target_warmup, cfg.target_steps)
        batch = sample_windows(train_t, cfg.target_batch, cfg.seq_len, gen)
        with autocast(device):
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_avg = loss.item() if loss_avg is None else 0.98 * loss_avg + 0.02 * loss.item()
        last = step + 1 == cfg.target_steps
        if (step + 1) % cfg.log_every == 0 or last:
            val = eval_loss(model, val_t, cfg.seq_len, cfg.val_windows, device)
            curve.append({"step": step + 1, "train_loss": round(loss_avg, 4), "val_loss": round(val, 4)})
            log(f"target step {step + 1}/{cfg.target_steps} loss {loss_avg:.4f} val {val:.4f} "
                f"({time.time() - t0:.0f}s)")
    stats = {
        "final_train_loss_ema": round(loss_avg, 4),
        "final_val_loss": curve[-1]["val_loss"],
        "train_seconds": round(time.time() - t0, 1),
        "tokens_seen": cfg.target_steps * cfg.target_batch * cfg.seq_len,
        "curve": curve,
    }
    return model.float(), stats


def save_target(model, out_dir: Path, tokenizer_dir: Path) -> None:
    """bf16 safetensors + config + tokenizer files, loadable by AutoModelForCausalLM/AutoTokenizer."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.float()
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # Readers that predate rope_parameters look for the top-level field.
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)


def load_target(path: Path, device: str, dtype: torch.dtype = torch.float32):
    """The saved target, in `dtype` (float32 by default: what generation and evaluation use)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()
