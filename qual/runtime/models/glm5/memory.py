"""What one rank of a GLM-5.3-Flash deployment holds, by part: as the embedded runtime allocates it, or as vLLM 0.32
allocates it (docs/glm5.md, "Memory"). A preflight asks whether an arm fits a GPU: `memory_plan(...).fits(bytes)`.

qual's plan is counted by the runtime's own code (sizing.py: the loader over meta-device shapes, the cache manager's
reservation per request). vLLM's is counted from its model and cache classes (vllm/models/glm5next and the mamba
and KV-cache specs), where it differs:
  - the embedding and the LM head are split by vocabulary across TP (VocabParallelEmbedding, ParallelLMHead; the
    vocabulary padded to a multiple of 64), where qual replicates them;
  - the dense and shared MLPs and the indexer's wq_b stay FP8 (its FP8 load paths), the router weight is bfloat16;
  - a KDA layer keeps, per request, 1 + K state blocks (MambaSpec num_speculative_blocks = K) whose convolution
    state is K - 1 + num_spec positions wide (kda_state_shape) where qual keeps K + 1 states of K - 1 positions;
    and the state page is padded to the MLA page of a block of 128-multiple tokens that holds it (vLLM unifies the
    two page sizes), so each request's latent blocks are that many tokens too;
  - the indexer's key cache is FP8: 128 e4m3 values and a float32 scale, 132 bytes a pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil

import torch

from qual.errors import QualError
from qual.options import DEFAULT_NUMERICS
from qual.runtime.models.glm5.config import INDEXED, LINEAR, Glm5Config
from qual.runtime.models.glm5.dsa import tail_ring_size
from qual.runtime.models.glm5.sizing import cache_bytes, weight_bytes

PLANS = ("qual", "vllm")  # who allocates: the embedded runtime, or vLLM 0.32
_QUAL_PARTS = {"routed experts": ("routed experts",), "embedding + lm_head": ("embedding", "lm_head"),
               "KDA": ("KDA",), "MLA + DSA indexer": ("MLA", "DSA indexer"),
               "dense MLP + shared experts + router": ("dense MLP", "shared experts", "router"),
               "norms, MHC": ("norms and MHC", "final norm")}
_VOCAB_PAD = 64  # vLLM pads the vocabulary of its parallel embedding and head to a multiple of this
_MLA_BLOCK_ALIGN = 128  # a hybrid MLA model's attention block size is a multiple of this (kernel alignment)
_FP8_SCALE = 4  # bytes of one float32 block scale


@dataclass(frozen=True)
class Deployment:
    """The serving setup a plan is for."""

    tp: int
    dcp: int
    num_speculative_tokens: int  # K
    context: int  # tokens a sequence holds at most
    sequences: int  # sequences resident at once
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16  # tokens per KV block on one rank (vLLM raises it to fit a KDA state page)
    numerics: str = DEFAULT_NUMERICS  # qual's plan: FP8 MLPs stay FP8 under vLLM's numerics


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's bytes: weights by part and caches by group."""

    plan: str  # one of PLANS
    weights: dict[str, int]
    caches: dict[str, int]
    notes: tuple[str, ...] = field(default=())

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def cache_bytes(self) -> int:
        return sum(self.caches.values())

    @property
    def total(self) -> int:
        return self.weight_bytes + self.cache_bytes

    def fits(self, gpu_bytes: float, utilization: float = 1.0) -> bool:
        """Whether weights and caches fit `utilization` of a GPU of `gpu_bytes` (activations and CUDA graphs not
        counted)."""
        return self.total <= gpu_bytes * utilization


def memory_plan(cfg: Glm5Config, d: Deployment, plan: str = "qual") -> MemoryPlan:
    """One rank's memory for deployment `d` as the runtime (plan "qual") or vLLM 0.32 ("vllm") allocates it."""
    if plan not in PLANS:
        raise QualError(f"memory plan must be one of {', '.join(PLANS)} (got {plan!r})")
    for key in ("num_attention_heads", "linear_num_heads", "intermediate_size", "moe_intermediate_size"):
        if getattr(cfg, key) % d.tp:
            raise QualError(f"{cfg.source}: {key}={getattr(cfg, key)} is not divisible by tp={d.tp}")
    return _qual(cfg, d) if plan == "qual" else _vllm(cfg, d)


def _qual(cfg: Glm5Config, d: Deployment) -> MemoryPlan:
    w = weight_bytes(cfg, d.tp, d.dtype, d.numerics)
    weights = {part: sum(w[k] for k in keys) for part, keys in _QUAL_PARTS.items()}
    caches = cache_bytes(cfg, d.tp, d.dcp, d.dtype, d.num_speculative_tokens, d.context, d.sequences, d.block_size)
    caches.pop("total")
    return MemoryPlan("qual", weights, caches)


def vllm_kda_state_bytes(cfg: Glm5Config, tp: int, dtype: torch.dtype, num_speculative_tokens: int) -> int:
    """One KDA layer's state block per request in vLLM (MambaStateShapeCalculator.kda_state_shape, kda_state_dtype):
    the convolution state [3 * H * D, K - 1 + num_spec] in the model dtype and the recurrent state [H, D, D] in
    float32, H = linear_num_heads / tp."""
    H, D, K = cfg.linear_num_heads // tp, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    b = torch.tensor([], dtype=dtype).element_size()
    return 3 * H * D * (K - 1 + num_speculative_tokens) * b + H * D * D * 4


def _fp8(rows: int, cols: int, block: tuple[int, int]) -> int:
    """Bytes of an FP8 weight [rows, cols] and its block scales."""
    return rows * cols + ceil(rows / block[0]) * ceil(cols / block[1]) * _FP8_SCALE


def _vllm(cfg: Glm5Config, d: Deployment) -> MemoryPlan:
    tp, b = d.tp, torch.tensor([], dtype=d.dtype).element_size()
    hid, L, R = cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    quant = cfg.quantization
    block = quant.block if quant else None
    lin = lambda rows, cols, fp8=False: _fp8(rows, cols, block) if fp8 and quant else rows * cols * b  # noqa: E731
    n_linear = cfg.layer_types.count(LINEAR)
    n_indexed = cfg.layer_types.count(INDEXED)
    n_sparse = cfg.mlp_layer_types.count("sparse")
    n_dense = cfg.num_hidden_layers - n_sparse
    # KDA: in_proj_qkvbfg_a (q, k, v and b split by TP; f_a, g_a replicated), f_b, g_b, o_proj; float32 convolutions,
    # dt_bias and A_log; the gated norm
    H, D, K = cfg.linear_num_heads // tp, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    kda = (lin(3 * H * D + H + 2 * D, hid) + 2 * lin(H * D, D) + lin(hid, H * D)
           + (3 * H * D * K + H * D + H) * 4 + D * b)
    # MLA: fused q_a | kv_a (NoPE checkpoints padded with R zero rows), q_b, kv_b, o_proj, the two norms; the indexer:
    # wq_b (FP8), wk | weights_proj (bfloat16), its float32 LayerNorm and position bias, the compress gate
    Hm = cfg.num_attention_heads // tp
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    mla = (lin(cfg.q_lora_rank + L + R, hid) + lin(Hm * cfg.qk_head_dim, cfg.q_lora_rank)
           + lin(Hm * (cfg.qk_nope_head_dim + cfg.v_head_dim), L) + lin(hid, Hm * cfg.v_head_dim)
           + (cfg.q_lora_rank + L) * b)
    indexer = (lin(Hi * Di, cfg.q_lora_rank, fp8=True) + lin(Di + Hi, hid) + 2 * Di * 4
               + cfg.index_kpool * Di * 4 + lin(Di, hid))
    E, Im = cfg.n_routed_experts, cfg.moe_intermediate_size // tp
    experts = E * (2 * lin(Im, hid, fp8=True) + lin(hid, Im, fp8=True))
    mlp = lambda inter: 2 * lin(inter // tp, hid, fp8=True) + lin(hid, inter // tp, fp8=True)  # noqa: E731
    shared = mlp(cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else 0
    router = E * hid * b + E * 4
    vocab = ceil(ceil(cfg.vocab_size / _VOCAB_PAD) * _VOCAB_PAD / tp) * hid * b
    n = cfg.hc_mult
    mhc = 2 * ((2 + n) * n * n * hid + (2 + n) * n + 3) * 4 if cfg.mhc else 0
    weights = {
        "routed experts": n_sparse * experts,
        "embedding + lm_head": vocab * (1 if cfg.tie_word_embeddings else 2),
        "KDA": n_linear * kda,
        "MLA + DSA indexer": n_indexed * mla + sum(1 for i in range(cfg.num_hidden_layers) if cfg.layer_types[i] ==
                                                   INDEXED and cfg.indexer_types[i] == "full") * indexer,
        "dense MLP + shared experts + router": n_dense * mlp(cfg.intermediate_size) + n_sparse * (shared + router),
        "norms, MHC": cfg.num_hidden_layers * (2 * hid * b + mhc) + hid * b,
    }
    # Caches. A KDA state block: conv [3*H*D, K - 1 + num_spec] in the model dtype, recurrent [H, D, D] float32;
    # 1 + num_spec blocks a request; the page padded to the MLA page of the block size that holds it.
    spec = d.num_speculative_tokens
    state_page = vllm_kda_state_bytes(cfg, tp, d.dtype, spec)
    latent_token = (L + R) * b  # the MLA cache entry (NoPE keeps its zero rope part)
    block = max(d.block_size, _MLA_BLOCK_ALIGN * ceil(state_page / (_MLA_BLOCK_ALIGN * latent_token)))
    page = block * latent_token
    local = ceil(d.context / d.dcp)  # a sequence's tokens on one DCP rank
    full = [i for i in range(cfg.num_hidden_layers) if cfg.layer_types[i] == INDEXED and cfg.indexer_types[i] == "full"]
    pools = ceil(d.context / cfg.index_kpool / d.dcp)
    ring = tail_ring_size(cfg.index_kpool, spec)
    caches = {
        "latent": d.sequences * n_indexed * ceil(local / block) * page,
        "index": d.sequences * len(full) * pools * (Di + 4 * ceil(Di / 128)),
        "index_tail": d.sequences * len(full) * ring * 2 * Di * 2,  # raw key and gate score, bfloat16
        "kda": d.sequences * n_linear * (1 + spec) * page,
    }
    notes = (f"attention block {block} tokens (a multiple of {_MLA_BLOCK_ALIGN} holding a KDA state page of "
             f"{state_page:,} bytes; the state padded to {page:,})",)
    return MemoryPlan("vllm", weights, caches, notes)
