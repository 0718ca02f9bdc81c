"""One rank: owns its weight shards and KV tensors, executes the broadcast steps."""

from __future__ import annotations

import torch

from qual.runtime.checkpoint import DFlashConfig, Qwen3Config, load_draft_config, load_target_config
from qual.runtime.config import EngineConfig
from qual.runtime.kv_cache import KVCacheGroup, KVCacheSpec
from qual.runtime.models.dflash import DFlashDrafter, DraftMeta
from qual.runtime.models.layers import HeadLayout
from qual.runtime.models.qwen3 import Qwen3Target, TargetMeta, causal_mask
from qual.runtime.paged import Geometry, KVStore, key_view, write_slots
from qual.runtime.parallel import Comm
from qual.runtime.steps import DecodeStep, PrefillStep, StepOutput

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
TARGET_GROUP = "target"


def draft_group_name(kind: str) -> str:
    return "draft" if kind == "full_attention" else "draft_sliding"


def plan_cache_groups(cfg: EngineConfig, target: Qwen3Config, draft: DFlashConfig | None, comm: Comm) -> list[KVCacheGroup]:
    """Target layers in one sharded group; draft layers grouped by attention kind, replicated or sharded."""
    nbytes = torch.tensor([], dtype=TORCH_DTYPES[cfg.dtype]).element_size()
    tl = HeadLayout.for_rank(target, comm)
    groups = [
        KVCacheGroup(
            TARGET_GROUP,
            KVCacheSpec("full", None, True, tl.num_kv_heads, tl.head_dim, nbytes),
            tuple(f"target.{i}" for i in range(target.num_hidden_layers)),
        )
    ]
    if draft is None:
        return groups
    dl = HeadLayout.for_rank(draft.layers, comm)
    by_name: dict[str, KVCacheGroup] = {}
    for i, kind in enumerate(draft.layer_types):
        window = draft.sliding_window if kind == "sliding_attention" else cfg.cache.draft_window
        spec = KVCacheSpec(
            "sliding" if kind == "sliding_attention" else "full", window, cfg.draft_kv == "sharded", dl.num_kv_heads, dl.head_dim, nbytes
        )
        g = KVCacheGroup(draft_group_name(kind), spec, (f"draft.{i}",))
        by_name[g.name] = by_name[g.name].merge(g) if g.name in by_name else g
    return groups + list(by_name.values())


def num_cache_blocks(cfg: EngineConfig, groups: list[KVCacheGroup]) -> int:
    return cfg.cache.memory_bytes // sum(g.block_bytes(cfg.cache.block_size) for g in groups)


class ModelRunner:
    """Executes prefill / decode steps on this rank."""

    def __init__(self, cfg: EngineConfig, comm: Comm):
        self.cfg, self.comm = cfg, comm
        dtype = TORCH_DTYPES[cfg.dtype]
        target_cfg = load_target_config(cfg.target_path)
        self.draft_cfg = load_draft_config(cfg.draft_path) if cfg.draft_path else None
        aux = self.draft_cfg.target_layer_ids if self.draft_cfg else ()
        self.target = Qwen3Target(cfg.target_path, comm, dtype, aux)
        self.drafter = DFlashDrafter(cfg.draft_path, comm, dtype, self.target) if cfg.draft_path else None
        self.groups = plan_cache_groups(cfg, target_cfg, self.draft_cfg, comm)
        self.num_blocks = num_cache_blocks(cfg, self.groups)
        B = cfg.cache.block_size
        self.stores = {
            g.name: KVStore(len(g.layers), self.num_blocks * B, g.spec.num_kv_heads, g.spec.head_dim, dtype, comm.device)
            for g in self.groups
        }
        self.geometry = {
            g.name: Geometry(B, comm.dcp_size if g.spec.sharded else 1, comm.dcp_rank if g.spec.sharded else 0, cfg.parallel.interleave)
            for g in self.groups
        }
        self.windows = {g.name: g.spec.window for g in self.groups}
        self.layer_slots = []
        if self.draft_cfg:
            for i, kind in enumerate(self.draft_cfg.layer_types):
                group = next(g for g in self.groups if f"draft.{i}" in g.layers)
                self.layer_slots.append((group.name, group.layers.index(f"draft.{i}")))
        self.pending: dict[str, torch.Tensor] = {}  # request -> aux features not yet in the draft cache
        self.K = (cfg.num_speculative_tokens or (self.draft_cfg.block_size - 1)) if self.draft_cfg else 0

    @property
    def kv_bytes(self) -> dict[str, int]:
        """Bytes each group's KV tensors take on this rank."""
        return {name: s.nbytes for name, s in self.stores.items()}

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.comm.device)

    def _target_meta(self, positions, rows, q_index, seq_lens, table) -> TargetMeta:
        geo = self.geometry[TARGET_GROUP]
        keys = key_view(geo, table, seq_lens)
        q_pos = positions[q_index.clamp(min=0)]
        mask = causal_mask(q_pos, q_index, keys)
        keys = type(keys)(self._dev(keys.slots), keys.positions, keys.valid)
        return TargetMeta(self._dev(write_slots(geo, positions, rows, table)), keys, self._dev(q_index), self._dev(mask))

    @torch.inference_mode()
    def execute(self, step) -> StepOutput | None:
        for rid in step.finished:
            self.pending.pop(rid, None)
        if isinstance(step, PrefillStep):
            return self._prefill(step)
        return self._decode(step)

    def _prefill(self, step: PrefillStep) -> StepOutput:
        lens = [len(p) for p in step.prompts]
        tokens = torch.tensor([t for p in step.prompts for t in p], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lens])
        rows = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lens)])
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        q = torch.arange(max(lens))
        q_index = torch.where(q[None, :] < torch.tensor(lens)[:, None], starts[:, None] + q[None, :], torch.tensor(-1))
        meta = self._target_meta(positions, rows, q_index, torch.tensor(lens), step.tables[TARGET_GROUP])
        hidden, aux = self.target.forward(self._dev(tokens), self._dev(positions), meta, self.stores[TARGET_GROUP])
        last = self._dev(starts + torch.tensor(lens) - 1)
        if aux is not None:
            for rid, s, n in zip(step.req_ids, starts.tolist(), lens):
                self.pending[rid] = aux[s : s + n]
        return StepOutput(self.target.logits(hidden[last]))

    def _decode(self, step: DecodeStep) -> StepOutput:
        R = len(step.req_ids)
        n = torch.tensor(step.num_committed)
        last = torch.tensor(step.last_tokens, dtype=torch.long)
        if self.drafter is None:
            draft_tokens = None
            tokens = last[:, None]
        else:
            draft_tokens = self._draft(step)
            tokens = torch.cat([last[:, None], draft_tokens.cpu()], dim=1)
        Q = tokens.shape[1]
        positions = ((n - 1)[:, None] + torch.arange(Q)[None, :]).reshape(-1)
        rows = torch.arange(R).repeat_interleave(Q)
        q_index = torch.arange(R * Q).view(R, Q)
        meta = self._target_meta(positions, rows, q_index, n - 1 + Q, step.tables[TARGET_GROUP])
        hidden, aux = self.target.forward(self._dev(tokens.reshape(-1)), self._dev(positions), meta, self.stores[TARGET_GROUP])
        if aux is not None:
            for i, rid in enumerate(step.req_ids):
                self.pending[rid] = aux[i * Q : (i + 1) * Q]
        return StepOutput(self.target.logits(hidden).view(R, Q, -1), draft_tokens)

    def _draft(self, step: DecodeStep) -> torch.Tensor:
        """Write new context K/V, run the block, return rank 0's argmax proposals [R, K] on every rank."""
        ctx_len, counts = torch.tensor(step.ctx_len), step.commit_counts
        feats = torch.cat([self.pending[rid][:c] for rid, c in zip(step.req_ids, counts)])
        ctx_pos = torch.cat([torch.arange(s, s + c) for s, c in zip(step.ctx_len, counts)])
        rows = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts))
        new_len = ctx_len + torch.tensor(counts)
        slots, keys = {}, {}
        for name, geo in self.geometry.items():
            if name == TARGET_GROUP:
                continue
            table = step.tables[name]
            slots[name] = self._dev(write_slots(geo, ctx_pos, rows, table))
            window = self.windows[name]
            view = key_view(geo, table, new_len, None if window is None else new_len - window)
            keys[name] = type(view)(self._dev(view.slots), view.positions, self._dev(view.valid))
        K = self.K
        block_pos = new_len[:, None] + torch.arange(K + 1)[None, :]
        block = torch.full((len(counts), K + 1), self.draft_cfg.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor(step.last_tokens)
        meta = DraftMeta(self._dev(ctx_pos), slots, keys, self._dev(block_pos))
        logits = self.drafter.forward(feats, self._dev(block), meta, self.stores, self.layer_slots)
        proposals = logits.argmax(dim=-1)
        # Every rank verifies rank 0's proposals, so ties cannot split the ranks.
        return self.comm.broadcast_tensor(proposals.contiguous())
