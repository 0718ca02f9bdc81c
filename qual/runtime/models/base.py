"""What the runner, the CUDA graphs and the DCP attention code rely on from a model (one seam per model).

A target or drafter module registers its class in qual/runtime/registry.py and implements the protocol
below: it parses its own config.json, checks a parallel layout against its heads, names its cache groups
and runs a forward pass over metadata the runner built (attention metadata is an argument, never global).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from qual.options import DEFAULT_DSA_TOPK, DEFAULT_NUMERICS
from qual.runtime.kv_cache import KVCacheGroup
from qual.runtime.paged import KeyView, KVStore


@dataclass
class AttentionView:
    """One cache group's metadata for one forward on this rank."""

    write_slots: torch.Tensor  # [T] slot of each new token here; not stored here = the store's trash slot
    keys: KeyView  # local keys per request (new tokens included)
    mask: torch.Tensor  # [R, Q, S] causal by global position
    key_positions: torch.Tensor | None = None  # [R, S] the keys' global positions on the device, where a model needs them


@dataclass
class TargetMeta:
    """Attention metadata of one target forward on this rank."""

    q_index: torch.Tensor  # [R, Q] flat token index, -1 = padding
    views: dict[str, AttentionView] = field(default_factory=dict)  # by cache group
    dense: bool = False  # every request has exactly Q query tokens (decode): no padding to strip
    # prompt tokens (dense in a padded prefill): the decode-only kernels do not apply; attention runs fused
    # (attention_with_lse)
    prefill: bool = False


@dataclass
class DraftMeta:
    """Metadata of one draft step on this rank, per draft cache group."""

    ctx_positions: torch.Tensor  # [Tc] positions of the new context tokens
    write_slots: dict[str, torch.Tensor]  # group -> [Tc]; not stored on this rank = the trash slot
    keys: dict[str, KeyView]  # group -> context keys per request (new ones included)
    block_positions: torch.Tensor  # [R, K+1]
    masks: dict[str, torch.Tensor] = field(default_factory=dict)  # group -> [R, K+1, S + K+1]: [context ; block] keys


@dataclass(frozen=True)
class ModelOptions:
    """What a run asks of a target beyond its checkpoint (from EngineConfig); a target reads the fields it has."""

    dsa_topk: str = DEFAULT_DSA_TOPK  # sparse-attention targets: the top-k under DCP (qual.options.DSA_TOPK_MODES)
    numerics: str = DEFAULT_NUMERICS  # targets that model vLLM's numerics: which form (qual.options.NUMERICS)


class TargetModel(Protocol):
    """A target architecture on one rank."""

    config: Any  # vocab_size, hidden_size, num_hidden_layers, eos_token_id
    embed: torch.Tensor  # [vocab, hidden]: drafters embed their block with it
    dtype: torch.dtype
    linear: Callable  # the backend's GEMM for projections (drafters use the same)
    aux_layer_ids: tuple[int, ...]  # ascending: layers whose outputs forward() concatenates as draft conditioning

    @staticmethod
    def parse_config(raw: dict, path: Path) -> Any: ...  # config.json -> validated config (QualError naming the key)

    @staticmethod
    def check_parallel(cfg: Any, parallel) -> None: ...  # QualError if the head layout cannot take tp / dcp

    sparse_attention: bool  # the target selects what it attends (DSA), so ModelOptions.dsa_topk applies to it
    vllm_numerics: bool  # the target models how vLLM computes it, so ModelOptions.numerics applies to it

    @staticmethod
    def notes(cfg: Any, numerics: str) -> list[str]: ...  # one line each: a default of this config that differs by numerics

    @staticmethod
    def cache_groups(cfg: Any, comm, dtype_bytes: int, num_speculative_tokens: int) -> list[KVCacheGroup]: ...

    def __init__(self, path: str | Path, cfg: Any, comm, dtype: torch.dtype, aux_layer_ids: tuple[int, ...],
                 backend, options: ModelOptions) -> None: ...

    def state_parts(self, group: str) -> dict: ...  # a "state" group's {part: (shape, dtype)} (targets with one)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: TargetMeta,
                stores: dict[str, KVStore]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens/positions [T] -> (final-normed hidden [T, hidden], aux features [T, n*hidden] or None)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class DraftModel(Protocol):
    """A drafter architecture on one rank (embedding and LM head are the target's)."""

    config: Any  # block_size, mask_token_id, target_layer_ids, layer_types, hidden size of its context features

    @staticmethod
    def parse_config(raw: dict, path: Path) -> Any: ...

    @staticmethod
    def check_parallel(cfg: Any, parallel) -> None: ...

    @staticmethod
    def check_target(cfg: Any, target_cfg: Any, path) -> None: ...  # QualError if it cannot draft for that target

    @staticmethod
    def cache_groups(cfg: Any, comm, dtype_bytes: int, draft_kv: str, draft_window: int | None) -> list[KVCacheGroup]: ...

    def __init__(self, path: str | Path, cfg: Any, comm, dtype: torch.dtype, target: TargetModel) -> None: ...

    def write_context(self, ctx_features, positions, write_slots: dict, stores: dict, layer_slots) -> None: ...

    def forward(self, ctx_features, block_tokens, meta, stores: dict, layer_slots) -> torch.Tensor:
        """Final-normed hidden states at the K mask positions, [R, K, hidden]."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # its LM head (the target's unless it ships one)

    def candidate_edges(self, hidden, logits, anchor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A candidate head's (candidate ids [R, K, k], edge scores [R, K, k, k]) for spec_decode's walk; None: the
        proposals are the argmax of the logits."""
