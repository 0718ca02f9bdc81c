"""MHC hyper-connections: n residual streams per token, mixed around every attention and MLP block.

Streams are [T, n, hidden]. Before a block, weights computed from the RMS-normed flattened streams collapse
them into the block input (pre); after it, the block output is expanded (post) and added to the streams
mixed by a doubly-stochastic matrix (comb). Replicated on every TP rank (no weights are split).

Without hyper-connections (vLLM's mhc: false) the residual is one stream [T, hidden] and every block is a plain
pre-norm residual: x + block(norm(x)). block_input / block_output / contract take either form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class HcWeights:
    fn: torch.Tensor  # [(2+n)*n, n*hidden]: pre, post and comb logits from the flattened streams (acc dtype)
    base: torch.Tensor  # [(2+n)*n] (acc dtype)
    scale: torch.Tensor  # [3]: pre, post, comb logit scales (acc dtype)
    sinkhorn_iters: int
    eps: float  # hc_eps: floor of pre/comb and of the Sinkhorn divisions
    norm_eps: float  # rms_norm_eps of the unweighted RMS norm


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate normalisations of [..., n, n] towards doubly stochastic: columns first, then
    iters - 1 rounds of rows then columns (transformers' order)."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_pre(w: HcWeights, streams: torch.Tensor):
    """streams [T, n, hidden] -> (post [T, n], comb [T, n, n], block input [T, hidden]); weights in acc dtype."""
    T, n, _ = streams.shape
    flat = streams.reshape(T, -1).to(w.fn.dtype)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + w.norm_eps)  # unweighted RMS norm
    pre_w, post_w, comb_w = F.linear(flat, w.fn).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = w.base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * w.scale[0] + pre_b) + w.eps
    post = 2 * torch.sigmoid(post_w * w.scale[1] + post_b)
    comb = torch.softmax((comb_w * w.scale[2] + comb_b).view(T, n, n), dim=-1) + w.eps
    comb = sinkhorn(comb, w.sinkhorn_iters, w.eps)
    collapsed = (pre[..., None] * streams).sum(1).to(streams.dtype)
    return post, comb, collapsed


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, n, hidden]: post[i] * block output + sum_j comb[j, i] * residual stream j."""
    dtype = residual.dtype
    return post.to(dtype)[..., None] * out[:, None, :] + comb.to(dtype).transpose(-1, -2) @ residual


def hc_expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """The embedding copied into n streams: [T, hidden] -> [T, n, hidden]."""
    return x[:, None, :].expand(-1, n, -1).contiguous()


def hc_contract(streams: torch.Tensor) -> torch.Tensor:
    """Final collapse (and the drafter's aux hidden state): the unweighted mean of the streams, [T, hidden]."""
    return streams.mean(1)


def block_input(w: HcWeights | None, residual: torch.Tensor):
    """(block input [T, hidden], how its output rejoins the residual): the streams' pre-collapse, or the one stream
    itself when there are no hyper-connections (w None)."""
    if w is None:
        return residual, None
    post, comb, collapsed = hc_pre(w, residual)
    return collapsed, (post, comb)


def block_output(out: torch.Tensor, residual: torch.Tensor, mix) -> torch.Tensor:
    """The residual after a block: streams mixed by (post, comb), or the plain sum."""
    return residual + out if mix is None else hc_post(out, residual, *mix)


def contract(residual: torch.Tensor) -> torch.Tensor:
    """The model's state [T, hidden]: the mean of the streams [T, n, hidden], or the one stream."""
    return hc_contract(residual) if residual.dim() == 3 else residual
