"""Stage 6: train the DFlash drafter on the target's continuations (the recipe in docs/dflash.md)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from qual.toy.config import TrainConfig
from qual.toy.drafter import DFlashDrafter, anchor_block_mask, grow_from, load_drafter
from qual.toy.target import autocast, lr_at, make_optimizer


def position_weights(block_size: int, device=None) -> torch.Tensor:
    """Loss weight of block position k: 0 at k=0 (the given token), exp(-(k-1)/(block_size-1)) after."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / (block_size - 1))
    w[0] = 0.0
    return w


def sample_anchors(prompt_lens: torch.Tensor, seq_len: int, num: int, block_size: int,
                   gen: torch.Generator) -> torch.Tensor:
    """[B, num] distinct anchors p with prompt_len-1 <= p <= seq_len-block_size, so x_{p+1..} are generated."""
    b = prompt_lens.shape[0]
    pos = torch.arange(seq_len)
    valid = (pos[None, :] >= (prompt_lens[:, None] - 1)) & (pos[None, :] <= seq_len - block_size)
    scores = torch.rand(b, seq_len, generator=gen).masked_fill(~valid, -1.0)
    return scores.topk(num, dim=1).indices


@torch.no_grad()
def target_aux(target, ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """[B, T, n*H]: outputs of target layers `layer_ids` (hidden_states[i+1]) concatenated; a GLM-5 layer's output is
    its hyper-connection streams [B, T, n, H], taken as their mean (where vLLM and the runtime capture them)."""
    return aux_features(target(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states, layer_ids)


def aux_features(hidden_states, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' hidden_states (embeddings, then each layer's output) -> the drafter's context input."""
    return torch.cat([hidden_states[i + 1].mean(2) if hidden_states[i + 1].dim() == 4 else hidden_states[i + 1]
                      for i in layer_ids], dim=-1)


def draft_loss(drafter: DFlashDrafter, target, ids: torch.Tensor, anchors: torch.Tensor,
               mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE, per-position top-1 accuracy [block_size]) for blocks at `anchors` of `ids` [B, T]."""
    s = drafter.shape
    bs = s.block_size
    b, t = ids.shape
    ctx = drafter.context(target_aux(target, ids, s.target_layer_ids))  # [B, T, H]
    block_pos = anchors[:, :, None] + torch.arange(bs, device=ids.device)  # [B, A, bs]
    block_ids = torch.full_like(block_pos, mask_token_id)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    block_pos, block_ids = block_pos.flatten(1), block_ids.flatten(1)  # [B, Q]
    x = target.get_input_embeddings()(block_ids)  # frozen, shared
    ctx_pos = torch.arange(t, device=ids.device).expand(b, t)
    masks = {"full_attention": anchor_block_mask(anchors, t, bs)}
    if "sliding_attention" in s.draft_kinds:
        masks["sliding_attention"] = anchor_block_mask(anchors, t, bs, s.draft_sliding_window)
    h = drafter(ctx, ctx_pos, x, block_pos, masks)
    logits = target.get_output_embeddings()(h).float()  # [B, Q, V] frozen, shared
    labels = ids.gather(1, block_pos)  # position k of the block predicts x_{p+k}
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(b, -1, bs)
    w = position_weights(bs, ids.device)
    loss = (ce * w).sum() / (w.sum() * b * anchors.shape[1])
    acc = (logits.argmax(-1) == labels).view(b, -1, bs).float().mean(dim=(0, 1))
    if s.dflash2:
        loss = loss + selector_loss(drafter, logits.view(b, -1, bs, logits.shape[-1]), h.view(b, -1, bs, h.shape[-1]),
                                    labels.view(b, -1, bs), w)
    return loss, acc


def selector_loss(drafter, logits: torch.Tensor, h: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """DFlash2's selector, teacher-forced: at each mask position, cross-entropy over its top-k candidates (when the
    target's token is among them) of the edge scores from the true previous token (the anchor for the first)."""
    sel = drafter.candidate_selector
    unary, cand = logits[:, :, 1:].detach().topk(sel.top_k, dim=-1)  # [B, A, K, k]
    prev = labels[:, :, :-1, None]  # the token before each mask position: anchor, then the true drafts
    scores = sel.edges(prev, cand, unary, h[:, :, 1:])[..., 0, :]  # [B, A, K, k]
    hit = cand == labels[:, :, 1:, None]
    found = hit.any(-1)
    ce = F.cross_entropy(scores.flatten(0, 2), hit.float().argmax(-1).flatten(), reduction="none").view(found.shape)
    weights = w[1:] * found
    return (ce * weights).sum() / weights.sum().clamp(min=1.0)


def _init_drafter(cfg: TrainConfig, device: str) -> DFlashDrafter:
    """A fresh drafter, or one grown from cfg.draft_init (same function, possibly more capacity)."""
    torch.manual_seed(cfg.seed + 2)
    drafter = DFlashDrafter(cfg.shape)
    if cfg.draft_init:
        init, _ = load_drafter(Path(cfg.draft_init), "cpu")
        grow_from(drafter, init)
    return drafter.to(device).train()


def _fit_steps(cfg: TrainConfig, step: int, elapsed: float, pace: float) -> int:
    """Total steps that fit cfg.draft_seconds at `pace` seconds a step (called once, at the end of warm-up)."""
    return max(step + 1, min(cfg.draft_steps, step + int((cfg.draft_seconds - elapsed) / pace)))


def train_drafter(cfg: TrainConfig, target, data: dict, mask_token_id: int,
                  device: str, log: Callable[[str], None]) -> tuple[DFlashDrafter, dict]:
    """Train a drafter against a frozen target; returns (drafter in float32, stats).

    `data` is generate_dataset's output: each step draws one chunk (rows of one
    length, chosen in proportion to its rows), then rows of it, then anchors.
    The draws use a CPU generator (the same on every device); the data lives on
    the device and nothing syncs with the host between log lines.
    """
    target.requires_grad_(False)
    drafter = _init_drafter(cfg, device)
    opt = make_optimizer(drafter, cfg.draft_lr, cfg.weight_decay, device)
    gen = torch.Generator().manual_seed(cfg.seed + 3)
    chunks = [c.to(device) for c in data["chunks"]]
    plens = data["prompt_lens"]
    sizes = torch.tensor([c.shape[0] for c in chunks], dtype=torch.float)
    pin = device.startswith("cuda")
    total = cfg.draft_steps
    t0, loss_avg, acc_avg, curve = time.time(), None, None, []
    step, half = 0, cfg.draft_warmup // 2
    t_half = t0
    while step < total:
        if step == half:
            t_half = time.time()  # the pace is timed over the warm-up's second half: start-up costs excluded
        if cfg.draft_seconds and step == cfg.draft_warmup:  # the LR so far does not depend on total
            pace = (time.time() - t_half) / max(1, step - half)
            total = _fit_steps(cfg, step, time.time() - t0, pace)
            log(f"draft: {total} steps fit {cfg.draft_seconds:.0f}s")
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.draft_lr, cfg.draft_warmup, total)
        c = int(torch.multinomial(sizes, 1, generator=gen))
        rows = torch.randint(0, chunks[c].shape[0], (cfg.draft_batch,), generator=gen)
        prompt_lens = torch.full((cfg.draft_batch,), plens[c])
        anchors = sample_anchors(prompt_lens, chunks[c].shape[1], cfg.anchors_per_seq, cfg.shape.block_size, gen)
        if pin:
            rows, anchors = rows.pin_memory(), anchors.pin_memory()
        ids = chunks[c][rows.to(device, non_blocking=True)].long()
        with autocast(device):
            loss, acc = draft_loss(drafter, target, ids, anchors.to(device, non_blocking=True), mask_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        loss, acc = loss.detach().float(), acc.detach()
        loss_avg = loss if loss_avg is None else 0.98 * loss_avg + 0.02 * loss
        acc_avg = acc if acc_avg is None else 0.98 * acc_avg + 0.02 * acc
        step += 1
        if step % cfg.log_every == 0 or step == total:
            accs = [round(float(a), 3) for a in acc_avg[1:]]
            curve.append({"step": step, "loss": round(float(loss_avg), 4), "acc_per_position": accs})
            log(f"draft step {step}/{total} loss {float(loss_avg):.4f} acc {accs} ({time.time() - t0:.0f}s)")
    cfg.draft_steps = total  # what ran: reproduce with --draft-steps total
    # Expected accepted length if positions were independent: sum of prefix products of accuracies.
    prefix = [math.prod(float(a) for a in acc_avg[1:k + 1]) for k in range(1, cfg.shape.block_size)]
    stats = {
        "final_loss_ema": round(float(loss_avg), 4),
        "final_acc_per_position_ema": curve[-1]["acc_per_position"],
        "train_seconds": round(time.time() - t0, 1),
        "approx_independent_tau": round(1 + sum(prefix), 3),
        "curve": curve,
    }
    return drafter.float(), stats
