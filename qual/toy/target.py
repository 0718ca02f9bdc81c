"""Stage 4: the Qwen3 target (transformers' Qwen3ForCausalLM) trained as a next-token LM on code."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from qual.checkpoints.io import load_weights, save_checkpoint
from qual.errors import QualError
from qual.files import copy_file, remove_tree, save_safetensors, write_text
from qual.toy.config import ModelShape, TrainConfig
from qual.toy.tokenizer import TOKENIZER_FILES
from qual.userfiles import MAX_TOKENIZER_BYTES, load_safetensors, read_json


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


# The GLM-5 target is saved as transformers' Glm5NextForConditionalGeneration (config glm5_next with a text_config),
# the form the runtime loads; it carries a one-block vision tower that nothing runs (the runtime skips it).
GLM_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=16,
                  projection_intermediate_size=16)


def build_target(cfg: TrainConfig, eos_token_id: int):
    """A freshly initialised target of cfg.arch, or cfg.target_init grown to its shape (qual/toy/grow.py)."""
    torch.manual_seed(cfg.seed)
    if cfg.arch == "glm5":
        from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

        text = cfg.glm.text_config(cfg.shape, eos_token_id)
        model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=GLM_VISION))
        return _grown(model, Path(cfg.target_init)) if cfg.target_init else model
    if cfg.target_init:
        raise QualError("target_init grows GLM-5 targets only (arch glm5)")
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(target_config(cfg.shape, eos_token_id))


def _grown(model, init: Path):
    """`model`'s architecture holding the checkpoint at `init` grown to its shape (qual/toy/grow.py): the tensors
    grown by their on-disk names, written beside the model's config and read back as load_target reads a target."""
    import tempfile

    from qual.toy.grow import grow_glm_state

    old = read_json(init / "config.json")["text_config"]
    grown = grow_glm_state(load_weights(init), old, model.config.text_config.to_dict())
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, model.config.to_dict(), grown)
        return load_target(Path(tmp), "cpu").train()


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
    """Train the target; returns (model in float32, stats dict). target_steps 0: the built (or grown) target as it
    is, with its validation loss."""
    model = build_target(cfg, eos_token_id).to(device)
    if cfg.target_steps == 0:
        t0 = time.time()
        val = eval_loss(model, torch.from_numpy(val_tokens.astype(np.int64)).to(device), cfg.seq_len, cfg.val_windows,
                        device)
        log(f"target: 0 steps ({'grown from ' + cfg.target_init if cfg.target_init else 'as initialised'}), "
            f"val {val:.4f}")
        return model.float(), {"final_val_loss": round(val, 4), "train_seconds": round(time.time() - t0, 1),
                               "tokens_seen": 0, "init": cfg.target_init, "curve": []}
    model.train()
    train_t = torch.from_numpy(train_tokens.astype(np.int64)).to(device)
    val_t = torch.from_numpy(val_tokens.astype(np.int64)).to(device)
    opt = make_optimizer(model, cfg.target_lr, cfg.weight_decay, device)
    gen = torch.Generator().manual_seed(cfg.seed)
    t0, curve = time.time(), []
    loss_avg, total, t_half, half = None, cfg.target_steps, t0, cfg.target_warmup // 2
    step = 0
    while step < total:
        if step == half:
            t_half = time.time()  # the pace is timed over the warm-up's second half: start-up costs excluded
        if cfg.target_seconds and step == cfg.target_warmup:  # the LR so far does not depend on total
            pace = (time.time() - t_half) / max(1, step - half)
            total = max(step + 1, min(total, step + int((cfg.target_seconds - (time.time() - t0)) / pace)))
            log(f"target: {total} steps fit {cfg.target_seconds:.0f}s")
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.target_lr, cfg.target_warmup, total)
        batch = sample_windows(train_t, cfg.target_batch, cfg.seq_len, gen)
        with autocast(device):
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_avg = loss.item() if loss_avg is None else 0.98 * loss_avg + 0.02 * loss.item()
        step += 1
        if step % cfg.log_every == 0 or step == total:
            val = eval_loss(model, val_t, cfg.seq_len, cfg.val_windows, device)
            curve.append({"step": step, "train_loss": round(loss_avg, 4), "val_loss": round(val, 4)})
            log(f"target step {step}/{total} loss {loss_avg:.4f} val {val:.4f} ({time.time() - t0:.0f}s)")
    cfg.target_steps = total  # what ran: reproduce with --set target_steps=total
    stats = {
        "final_train_loss_ema": round(loss_avg, 4),
        "final_val_loss": curve[-1]["val_loss"],
        "train_seconds": round(time.time() - t0, 1),
        "tokens_seen": total * cfg.target_batch * cfg.seq_len,
        "curve": curve,
    }
    return model.float(), stats


def save_target(model, out_dir: Path, tokenizer_dir: Path, fp8_block: tuple[int, ...] = ()) -> None:
    """bf16 safetensors + config + tokenizer files, loadable by AutoModelForCausalLM/AutoTokenizer; with fp8_block,
    what vLLM keeps FP8 is block-quantized from the float weights instead (config.json's quantization_config says
    so; load_target reads it back)."""
    if out_dir.exists():
        remove_tree(out_dir)
    out_dir.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.float()
    cfg_path = out_dir / "config.json"
    cfg = read_json(cfg_path)
    if cfg.get("model_type") == "qwen3":  # readers that predate rope_parameters look for the top-level field
        cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    if fp8_block:
        _quantize_saved(out_dir, tuple(fp8_block))
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(fp8_block)}
    write_text(cfg_path, json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        copy_file(tokenizer_dir / name, out_dir / name, MAX_TOKENIZER_BYTES, "tokenizer file")


def _quantize_saved(out_dir: Path, block: tuple[int, int]) -> None:
    """The saved safetensors rewritten: each weight vLLM keeps FP8 block-quantized from its saved value."""
    from qual.checkpoints.fp8 import SCALE_SUFFIX, quantize
    from qual.runtime.models.glm5.fp8_weights import FP8_KEPT, fp8_load_path

    for f in sorted(out_dir.glob("*.safetensors")):
        tensors = load_safetensors(f)
        for name in [n for n in tensors if fp8_load_path(n) == FP8_KEPT and ".visual." not in n]:
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize(tensors[name].float(), block)
        save_safetensors(f, tensors)


def load_target(path: Path, device: str, dtype: torch.dtype = torch.float32):
    """The saved target, in `dtype` (float32 by default: what generation and evaluation use). FP8 block-quantized
    weights are dequantized as the runtime dequantizes them (numerics exact)."""
    config = read_json(Path(path) / "config.json")
    if config.get("model_type") == "glm5_next":
        from transformers import Glm5NextForConditionalGeneration as Model
    else:
        from transformers import AutoModelForCausalLM as Model

    if "quantization_config" not in config:
        return Model.from_pretrained(path, dtype=dtype).to(device).eval()
    import tempfile

    from qual.checkpoints.fp8 import SCALE_SUFFIX, dequantize

    block = tuple(config.pop("quantization_config")["weight_block_size"])
    tensors = load_weights(path)
    plain = {name: dequantize(t, tensors[name + SCALE_SUFFIX], block, torch.float32) if name + SCALE_SUFFIX in tensors
             else t for name, t in tensors.items() if not name.endswith(SCALE_SUFFIX)}
    with tempfile.TemporaryDirectory() as tmp:  # transformers maps the on-disk names to its modules as it loads
        save_checkpoint(tmp, config, plain)
        return Model.from_pretrained(tmp, dtype=dtype).to(device).eval()
