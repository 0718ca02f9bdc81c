"""A trained GLM-5 toy target grown into wider shapes that compute the same function (the target stage's
`target_init`): how glm-toy-vllm starts from glm-toy's target.

Each widening keeps every output of the model as it was, up to the rounding of the normalisations' eps:
  - an MLP's (dense, shared, each expert's) intermediate width and MLA's q_lora / kv_lora ranks grow by zero rows in
    the projections that write them and zero columns in those that read them; an RMSNorm over a grown rank is
    rescaled by sqrt(old / new), since the added zeros lower its mean square by that factor;
  - the indexer's head dim grows by copies: its keys (wk, the LayerNorm, the compress gate and position bias)
    repeat the old channels r times, so each pooled key is r copies of the old one (a LayerNorm over copies is the
    copies of the LayerNorm), and each query head holds the old query times sqrt(r) followed by zeros, so
    q . k / sqrt(r * Di) is the old score (a common factor would select the same pools; this keeps the scores).
A zero-grown channel receives no gradient (its input and output weights are both zero), so further training leaves
the grown widths at zero: the grown model computes with the old widths inside the new shapes.
"""

from __future__ import annotations

import math

import torch

from qual.errors import QualError
from qual.runtime.models.glm5.fp8_weights import MLP_WEIGHT


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])]) if n > t.shape[0] else t


def _cols(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(t.shape[0], n - t.shape[1])], dim=1) if n > t.shape[1] else t


def _norm(t: torch.Tensor, n: int) -> torch.Tensor:
    """An RMSNorm weight over a rank grown from len(t) to n by zeros."""
    return torch.cat([t * math.sqrt(t.shape[0] / n), t.new_ones(n - t.shape[0])]) if n > t.shape[0] else t


# MLA's low-rank projections: each grows its rows (a down projection), its norm or its columns (an up projection)
# to the new rank
_LORA = ((".self_attn.q_a_proj.weight", _rows, "q_lora_rank"),
         (".self_attn.q_a_layernorm.weight", _norm, "q_lora_rank"),
         (".self_attn.q_b_proj.weight", _cols, "q_lora_rank"),
         (".self_attn.kv_a_proj_with_mqa.weight", _rows, "kv_lora_rank"),
         (".self_attn.kv_a_layernorm.weight", _norm, "kv_lora_rank"),
         (".self_attn.kv_b_proj.weight", _cols, "kv_lora_rank"))


def grow_glm_state(state: dict[str, torch.Tensor], old: dict, new: dict) -> dict[str, torch.Tensor]:
    """`state` (a checkpoint's tensors, by their on-disk names) of a GLM-5 text stack with text config `old`, as a
    state of text config `new` computing the same function. Only the widths named above may differ (the rest is
    refused by name)."""
    same = ("hidden_size", "num_hidden_layers", "num_attention_heads", "qk_nope_head_dim", "v_head_dim",
            "index_n_heads", "index_kpool", "linear_num_heads", "linear_head_dim", "n_routed_experts", "hc_mult")
    for key in same:
        if old.get(key) != new.get(key):
            raise QualError(f"target_init: {key} {old.get(key)} -> {new.get(key)} cannot be grown (only MLP widths, "
                            f"q_lora_rank, kv_lora_rank and index_head_dim can)")
    grown = {"intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank", "index_head_dim"}
    for key in grown:
        if new[key] < old[key] or (key == "index_head_dim" and new[key] % old[key]):
            raise QualError(f"target_init: {key} {old[key]} -> {new[key]}: widths grow (index_head_dim by a whole "
                            f"multiple)")
    r = new["index_head_dim"] // old["index_head_dim"]
    Hi, Di = new["index_n_heads"], old["index_head_dim"]
    q_lora = new["q_lora_rank"]
    out = {}
    for name, t in state.items():  # in the checkpoint's dtype: a rescaled norm weight is rounded to it
        leaf = name.rsplit(".", 2)
        if ".visual." in name:
            pass  # the vision tower is not grown (and not run)
        elif MLP_WEIGHT.search(name):
            inter = new["intermediate_size" if ".experts." not in name and ".shared_experts." not in name
                        else "moe_intermediate_size"]
            if ".shared_experts." in name:
                inter *= new["n_shared_experts"]
            t = _cols(t, inter) if name.endswith("down_proj.weight") else _rows(t, inter)
        elif (lora := next(((grow, rank) for suffix, grow, rank in _LORA if name.endswith(suffix)), None)):
            t = lora[0](t, new[lora[1]])
        elif ".indexer." in name:
            if name.endswith("wq_b.weight"):  # [Hi*Di, q_lora]: each head's query scaled by sqrt(r), then zeros
                heads = t.view(Hi, Di, -1) * math.sqrt(r)
                padded = torch.cat([heads, heads.new_zeros(Hi, Di * (r - 1), heads.shape[-1])], 1)
                t = _cols(padded.reshape(Hi * Di * r, -1), q_lora)
            elif leaf[-1] == "index_kpool_compress_ape":  # [kpool, Di]
                t = t.repeat(1, r)
            elif name.endswith(("wk.weight", "k_norm.weight", "k_norm.bias", "index_kpool_compress_gate")):
                t = t.repeat(r, *([1] * (t.dim() - 1)))
        out[name] = t.contiguous()
    return out
