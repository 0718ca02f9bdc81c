"""Token choice from target logits: greedy, or Gumbel-max with noise fixed by (seed, request, position).

Keying the noise by position makes the sampled text independent of how many tokens the
drafter proposed, so two arms with the same target draw the same tokens.
"""

from __future__ import annotations

import zlib

import torch


def _noise_seed(seed: int, request_key: str, position: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(request_key.encode()) * 10_007 + position) % (2**63 - 1)


def choose_tokens(logits: torch.Tensor, temperature: float, seed: int, request_key: str, first_position: int) -> list[int]:
    """logits [Q, V] predict positions first_position .. first_position+Q-1; returns Q token ids."""
    if temperature == 0:
        return logits.argmax(dim=-1).tolist()
    out = []
    for j, row in enumerate(logits.float()):
        g = torch.Generator().manual_seed(_noise_seed(seed, request_key, first_position + j))
        u = torch.rand(row.shape, generator=g).clamp_(1e-20, 1.0)
        out.append(int(torch.argmax(row / temperature - torch.log(-torch.log(u)))))
    return out


def margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row of [..., V] (small = near tie), float32."""
    top = logits.topk(2, dim=-1).values.float()
    return top[..., 0] - top[..., 1]


def top2_margins(logits: torch.Tensor) -> list:
    """margins() as nested lists."""
    return margins(logits).tolist()


def pack_choices(logits: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
    """Greedy tokens, top-2 margins and proposals of logits [R, Q, V] and drafts [R, K] as one int64 [R, 2Q + K],
    computed where the logits are, so that one copy brings a step's results to the host (unpack_choices).

    The margins travel as their float32 bit patterns (sign-extended to int64): unpacked, they are the very
    float32 values margins() gives.
    """
    tokens = logits.argmax(dim=-1)
    bits = margins(logits).view(torch.int32).long()
    parts = [tokens, bits] + ([] if drafts is None else [drafts.long()])
    return torch.cat(parts, dim=1)


def unpack_choices(packed: torch.Tensor, q: int) -> tuple[list, list, list | None]:
    """(tokens [R][Q], margins [R][Q], proposals [R][K] or None) from pack_choices' [R, 2Q + K] on the host."""
    tokens = packed[:, :q].tolist()
    margins = packed[:, q : 2 * q].int().view(torch.float32).tolist()
    drafts = packed[:, 2 * q :].tolist() if packed.shape[1] > 2 * q else None
    return tokens, margins, drafts
