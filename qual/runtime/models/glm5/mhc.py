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
    # vLLM's mhc_pre / mhc_post (numerics vllm): the RMS factor applied to the mix logits after the GEMM, and the
    # residual mix in float32 rounded once; else transformers' form (normalise first; mix in the streams' dtype)
    float32_mix: bool = False


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
    if w.float32_mix:  # mhc_pre_torch: the GEMM first, then the unweighted RMS factor sum(x^2) / (n * hidden)
        mixes = F.linear(flat, w.fn) * torch.rsqrt(flat.square().sum(-1, keepdim=True) / flat.shape[-1] + w.norm_eps)
    else:
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + w.norm_eps)  # unweighted RMS norm
        mixes = F.linear(flat, w.fn)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = w.base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * w.scale[0] + pre_b) + w.eps
    post = 2 * torch.sigmoid(post_w * w.scale[1] + post_b)
    comb = torch.softmax((comb_w * w.scale[2] + comb_b).view(T, n, n), dim=-1) + w.eps
    comb = sinkhorn(comb, w.sinkhorn_iters, w.eps)
    collapsed = (pre[..., None] * streams).sum(1).to(streams.dtype)
    return post, comb, collapsed


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            float32_mix: bool = False) -> torch.Tensor:
    """New streams [T, n, hidden]: post[i] * block output + sum_j comb[j, i] * residual stream j. transformers casts
    post and comb to the streams' dtype and mixes there; vLLM's mhc_post mixes in (at least) float32 and rounds once."""
    dtype = residual.dtype
    if float32_mix:
        acc = torch.promote_types(dtype, torch.float32)
        mixed = torch.einsum("tij,tih->tjh", comb.to(acc), residual.to(acc))
        return (mixed + post.to(acc)[..., None] * out[:, None, :].to(acc)).to(dtype)
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
    return collapsed, (post, comb, w.float32_mix)


def block_output(out: torch.Tensor, residual: torch.Tensor, mix) -> torch.Tensor:
    """The residual after a block: streams mixed by (post, comb) in the weights' form, or the plain sum."""
    return residual + out if mix is None else hc_post(out, residual, *mix)


def contract(residual: torch.Tensor) -> torch.Tensor:
    """The model's state [T, hidden]: the mean of the streams [T, n, hidden], or the one stream."""
    return hc_contract(residual) if residual.dim() == 3 else residual
