"""GLM-5.3-Flash weights from safetensors (transformers' on-disk names), sliced for one TP rank.

The text stack sits under "model.language_model." (Glm5NextForConditionalGeneration) or at the top level
(Glm5NextTextModel; "model." is accepted too); vision tensors ("model.visual.") and MTP layers (index >=
num_hidden_layers) are skipped. FP8 block-quantized weights (qual/checkpoints/fp8.py) are dequantized as they are
read but where fp8_weights.py keeps them FP8 as vLLM does. TP: KDA and MLA heads, the dense MLP, the shared experts
and each routed expert's intermediate dim are split; the MLA latent path (q_a, kv_a), the DSA indexer, the router, the
MHC weights, the norms, the embedding and lm_head are replicated. Every block returns a row-parallel partial.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from qual.checkpoints.fp8 import SCALE_SUFFIX, BlockFp8, dequantize, scale_shape
from qual.errors import QualError
from qual.options import DEFAULT_NUMERICS
from qual.userfiles import open_safetensors
from qual.runtime.models.glm5.common import acc_dtype
from qual.runtime.models.glm5.config import INDEXED, Glm5Config, load_glm5_config
from qual.runtime.models.glm5.dsa import IndexerWeights
from qual.runtime.models.glm5.kda import KdaWeights
from qual.runtime.models.glm5.mhc import HcWeights
from qual.runtime.models.glm5.mla import MlaWeights
from qual.runtime.models.glm5.fp8_weights import (FP8_KEPT, check_mlp_blocks, fp8_experts, fp8_load_path, fp8_mlp,
                                                  kept_fp8)
from qual.runtime.models.glm5.moe import Fp8Experts, MlpWeights, MoeWeights
from qual.runtime.models.glm5.numerics import Numerics, numerics_of, safe_gate_bound

_PREFIXES = ("model.language_model.", "model.", "")
_VISION = ("model.visual.", "visual.")


@dataclass
class LayerWeights:
    kind: str  # config.layer_types entry
    attn_hc: HcWeights | None  # None without hyper-connections (mhc false)
    ffn_hc: HcWeights | None
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    kda: KdaWeights | None = None
    mla: MlaWeights | None = None
    indexer: IndexerWeights | None = None  # indexed layers of indexer type "full"
    mlp: MlpWeights | None = None
    moe: MoeWeights | None = None


@dataclass
class Glm5Weights:
    cfg: Glm5Config
    tp_rank: int
    tp_size: int
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor | None  # [vocab, hidden]; None for a bare Glm5NextTextModel checkpoint
    norm: torch.Tensor  # [hidden]
    layers: list[LayerWeights]
    prefix: str  # where the text stack sits in the checkpoint
    vision_tensors_skipped: int


class _Reader:
    """Tensors of a checkpoint directory, read on demand with their shapes checked first; FP8 block-quantized ones
    dequantized (get) or kept with their scales (get_fp8)."""

    def __init__(self, path: Path, quantization: BlockFp8 | None, acc: torch.dtype):
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise QualError(f"checkpoint {path} has no *.safetensors files")
        self.path, self.quantization, self.acc, self.handles, self.used = path, quantization, acc, {}, set()
        for f in files:
            h = open_safetensors(f, "pt")  # a FIFO or device named *.safetensors is refused, never waited on
            for name in h.keys():
                self.handles[name] = h
        scaled = next((n for n in self.handles if n.endswith(SCALE_SUFFIX)), None)
        if scaled and quantization is None:
            raise QualError(f"checkpoint {path}: tensor {scaled!r} is an FP8 scale, but config.json has no "
                            f"quantization_config")

    def _raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.handles:
            raise QualError(f"checkpoint {self.path}: missing tensor {name!r}")
        got = tuple(self.handles[name].get_slice(name).get_shape())
        if got != tuple(shape):
            raise QualError(f"checkpoint {self.path}: tensor {name!r} has shape {got}, expected {tuple(shape)}")
        self.used.add(name)
        return self.handles[name].get_tensor(name)

    def is_fp8(self, name: str) -> bool:
        return name + SCALE_SUFFIX in self.handles

    def get_fp8(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(W8, scale_inv) of an FP8 block-quantized weight, None for a weight stored unquantized."""
        if name + SCALE_SUFFIX not in self.handles:
            return None
        if fp8_load_path(name) is None:
            raise QualError(f"checkpoint {self.path}: tensor {name!r} is FP8 (it has {SCALE_SUFFIX} scales), but vLLM "
                            "0.32 has no FP8 load path for it (it keeps the MLPs, experts and indexer wq_b FP8 and "
                            "dequantizes MLA's q_a/kv_a/q_b/o_proj and the indexer's wk): store it unquantized")
        module = name.rsplit(".", 1)[0]
        listed = next((m for m in self.quantization.unquantized if module.endswith(m) or module.startswith(m)), None)
        if listed:
            raise QualError(f"checkpoint {self.path}: tensor {name!r} has FP8 scales, but quantization_config "
                            f"lists {listed!r} as not converted")
        weight = self._raw(name, shape)
        if weight.dtype != torch.float8_e4m3fn:
            raise QualError(f"checkpoint {self.path}: tensor {name!r} has FP8 scales but is stored as {weight.dtype} "
                            f"(float8_e4m3fn expected)")
        scale = self._raw(name + SCALE_SUFFIX, scale_shape(shape, self.quantization.block))
        return weight, scale.float()

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor as the model uses it: FP8 block-quantized weights dequantized (accumulation dtype)."""
        fp8 = self.get_fp8(name, shape)
        if fp8 is not None:
            return dequantize(*fp8, self.quantization.block, self.acc)
        t = self._raw(name, shape)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise QualError(f"checkpoint {self.path}: tensor {name!r} is stored as {t.dtype} without "
                            f"{name + SCALE_SUFFIX!r} (FP8 weights need their block scales)")
        return t


@dataclass
class _Load:
    """What every part of the loader reads: the checkpoint, its config, this rank and the run's dtype."""

    rd: _Reader
    cfg: Glm5Config
    rank: int
    tp: int
    dtype: torch.dtype
    device: str | torch.device
    acc: torch.dtype  # at least float32: norms, gates, router, MHC
    numerics: Numerics  # how the run computes: which FP8 weights stay FP8, the indexer's and MHC's forms

    def cast(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return t.to(device=self.device, dtype=dtype or self.dtype)


def _split(total: int, tp: int, key: str, cfg: Glm5Config) -> int:
    if total % tp:
        raise QualError(f"{cfg.source}: {key}={total} is not divisible by tp={tp}")
    return total // tp


def load_glm5_weights(path: str | Path, tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", numerics: str | Numerics = DEFAULT_NUMERICS) -> Glm5Weights:
    """This TP rank's shard of a GLM-5.3-Flash checkpoint, in `dtype` (precision-critical small tensors in at
    least float32, as transformers keeps them), for a run of the given numerics (qual.options.NUMERICS)."""
    path = Path(path)
    cfg = load_glm5_config(path)
    return _load(_Reader(path, cfg.quantization, acc_dtype(dtype)), cfg, tp_rank, tp_size, dtype, device,
                 _numerics(numerics))


def _numerics(numerics: str | Numerics) -> Numerics:
    return numerics if isinstance(numerics, Numerics) else numerics_of(numerics)


def shaped_glm5_weights(cfg: Glm5Config, tp_rank: int, tp_size: int, dtype: torch.dtype,
                        numerics: str | Numerics = DEFAULT_NUMERICS) -> Glm5Weights:
    """The weights the loader builds for `cfg`, on the meta device (shapes and dtypes, no data): what sizing counts,
    so a rank's weight bytes come from the loader itself. An FP8 config is taken as vLLM's coverage (every tensor
    vLLM keeps FP8 stored FP8, the rest unquantized)."""
    return _load(_Shapes(cfg), cfg, tp_rank, tp_size, dtype, "meta", _numerics(numerics))


class _Shapes:
    """A checkpoint of `cfg` as the loader reads it, without data: tensors on the meta device; with FP8
    quantization, what vLLM keeps FP8 arrives quantized (the loader dequantizes what the numerics do not keep)."""

    def __init__(self, cfg: Glm5Config):
        self.path, self.quantization, self.used = Path(cfg.source), cfg.quantization, set()
        head = [] if cfg.tie_word_embeddings else ["lm_head.weight"]
        self.handles = dict.fromkeys(["model.language_model.embed_tokens.weight", *head])

    def is_fp8(self, name: str) -> bool:
        return self.quantization is not None and fp8_load_path(name) == FP8_KEPT

    def get_fp8(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.is_fp8(name):
            return None
        return (torch.empty(shape, dtype=torch.float8_e4m3fn, device="meta"),
                torch.empty(scale_shape(shape, self.quantization.block), dtype=torch.float32, device="meta"))

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        self.used.add(name)
        return torch.empty(shape, device="meta")


def _load(rd, cfg: Glm5Config, tp_rank: int, tp_size: int, dtype: torch.dtype, device,
          numerics: Numerics) -> Glm5Weights:
    path = rd.path
    if not 0 <= tp_rank < tp_size:
        raise QualError(f"tp_rank={tp_rank} is outside tp_size={tp_size}")
    acc = acc_dtype(dtype)
    prefix = next((p for p in _PREFIXES if p + "embed_tokens.weight" in rd.handles), None)
    if prefix is None:
        raise QualError(f"checkpoint {path}: missing tensor 'model.language_model.embed_tokens.weight'")
    ctx = _Load(rd, cfg, tp_rank, tp_size, dtype, device, acc, numerics)
    cast = ctx.cast
    V, hid = cfg.vocab_size, cfg.hidden_size
    embed = cast(rd.get(prefix + "embed_tokens.weight", (V, hid)))
    if cfg.tie_word_embeddings:
        lm_head = embed
    elif "lm_head.weight" in rd.handles or prefix:
        lm_head = cast(rd.get("lm_head.weight", (V, hid)))
    else:
        lm_head = None  # a bare text model has no head
    layers = [_layer(ctx, f"{prefix}layers.{i}.", i) for i in range(cfg.num_hidden_layers)]
    norm = cast(rd.get(prefix + "norm.weight", (hid,)))
    vision = [n for n in rd.handles if n.startswith(_VISION)]
    mtp = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    for name in rd.handles:
        m = mtp.match(name)
        if name in rd.used or name in vision or (m and int(m.group(1)) >= cfg.num_hidden_layers):
            continue
        raise QualError(f"checkpoint {path}: unexpected tensor {name!r} (not used by this config)")
    return Glm5Weights(cfg, tp_rank, tp_size, embed, lm_head, norm, layers, prefix, len(vision))


def _layer(ctx: _Load, p: str, i: int) -> LayerWeights:
    rd, cfg, cast, acc = ctx.rd, ctx.cfg, ctx.cast, ctx.acc
    hid, n = cfg.hidden_size, cfg.hc_mult

    def hc(which: str) -> HcWeights | None:
        if not cfg.mhc:
            return None
        mix = (2 + n) * n
        get = lambda part, shape: cast(rd.get(f"{p}hc_{which}_{part}", shape), acc)  # noqa: E731
        return HcWeights(get("fn", (mix, n * hid)), get("base", (mix,)), get("scale", (3,)),
                         cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, float32_mix=ctx.numerics.hc_float32)

    lw = LayerWeights(cfg.layer_types[i], hc("attn"), hc("ffn"), cast(rd.get(p + "input_layernorm.weight", (hid,))),
                      cast(rd.get(p + "post_attention_layernorm.weight", (hid,))))
    if lw.kind == INDEXED:
        lw.mla = _mla(ctx, p + "self_attn.")
        if cfg.indexer_types[i] == "full":
            lw.indexer = _indexer(ctx, p + "self_attn.indexer.")
    else:
        lw.kda = _kda(ctx, p + "self_attn.")
    if cfg.mlp_layer_types[i] == "sparse":
        lw.moe = _moe(ctx, p + "mlp.")
    else:
        lw.mlp = _mlp(ctx, p + "mlp.", cfg.intermediate_size, "intermediate_size")
    return lw


def _kda(ctx: _Load, p: str) -> KdaWeights:
    rd, cfg, rank, tp, cast, acc = ctx.rd, ctx.cfg, ctx.rank, ctx.tp, ctx.cast, ctx.acc
    H, D, K, hid = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim, cfg.hidden_size
    Hl = _split(H, tp, "linear_num_heads", cfg)
    heads, rows = slice(rank * Hl, (rank + 1) * Hl), slice(rank * Hl * D, (rank + 1) * Hl * D)
    proj = [rd.get(f"{p}{x}_proj.weight", (H * D, hid))[rows] for x in "qkv"]
    conv = [rd.get(f"{p}{x}_conv1d.weight", (H * D, 1, K))[rows, 0] for x in "qkv"]
    return KdaWeights(
        qkv=cast(torch.cat(proj)), conv=cast(torch.cat(conv), acc),
        f_a=cast(rd.get(p + "f_a_proj.weight", (D, hid))), f_b=cast(rd.get(p + "f_b_proj.weight", (H * D, D))[rows]),
        dt_bias=cast(rd.get(p + "dt_bias", (H * D,))[rows], acc), a_log=cast(rd.get(p + "A_log", (H,))[heads], acc),
        b=cast(rd.get(p + "b_proj.weight", (H, hid))[heads]),
        g_a=cast(rd.get(p + "g_a_proj.weight", (D, hid))), g_b=cast(rd.get(p + "g_b_proj.weight", (H * D, D))[rows]),
        o_norm=cast(rd.get(p + "o_norm.weight", (D,))), o_proj=cast(rd.get(p + "o_proj.weight", (hid, H * D))[:, rows]),
        num_heads=Hl, head_dim=D, lower_bound=safe_gate_bound(cfg.linear_lower_bound, ctx.numerics),
        eps=cfg.rms_norm_eps,
    )


def _mla(ctx: _Load, p: str) -> MlaWeights:
    rd, cfg, rank, tp, cast = ctx.rd, ctx.cfg, ctx.rank, ctx.tp, ctx.cast
    H, hid, qlr, L = cfg.num_attention_heads, cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    Dn, Dv, Dqk = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
    Hl = _split(H, tp, "num_attention_heads", cfg)
    h0 = rank * Hl
    kv_b = rd.get(p + "kv_b_proj.weight", (H * (Dn + Dv), L))[h0 * (Dn + Dv):(h0 + Hl) * (Dn + Dv)].view(Hl, Dn + Dv, L)
    return MlaWeights(
        q_a=cast(rd.get(p + "q_a_proj.weight", (qlr, hid))), q_a_norm=cast(rd.get(p + "q_a_layernorm.weight", (qlr,))),
        q_b=cast(rd.get(p + "q_b_proj.weight", (H * Dqk, qlr))[h0 * Dqk:(h0 + Hl) * Dqk]),
        # Under mla_use_nope the checkpoint holds the latent rows only (vLLM pads zero rope rows: k_pe = 0)
        kv_a=cast(rd.get(p + "kv_a_proj_with_mqa.weight", (L + cfg.mla_rope_dim, hid))),
        kv_a_norm=cast(rd.get(p + "kv_a_layernorm.weight", (L,))),
        w_uk=cast(kv_b[:, :Dn].contiguous()), w_uv=cast(kv_b[:, Dn:].contiguous()),
        o_proj=cast(rd.get(p + "o_proj.weight", (hid, H * Dv))[:, h0 * Dv:(h0 + Hl) * Dv]),
        eps=cfg.rms_norm_eps, scale=cfg.attention_scale, rope_dim=cfg.mla_rope_dim,
    )


def _indexer(ctx: _Load, p: str) -> IndexerWeights:
    rd, cfg, cast, acc = ctx.rd, ctx.cfg, ctx.cast, ctx.acc
    Hi, Di, hid = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    wq_b = kept_fp8(ctx, p + "wq_b.weight", (Hi * Di, cfg.q_lora_rank))
    return IndexerWeights(
        wq_b=wq_b if wq_b is not None else cast(rd.get(p + "wq_b.weight", (Hi * Di, cfg.q_lora_rank))),
        wk=cast(rd.get(p + "wk.weight", (Di, hid))),
        k_norm_weight=cast(rd.get(p + "k_norm.weight", (Di,))), k_norm_bias=cast(rd.get(p + "k_norm.bias", (Di,))),
        weights_proj=cast(rd.get(p + "weights_proj.weight", (Hi, hid))),
        compress_gate=cast(rd.get(p + "index_kpool_compress_gate", (Di, hid))),
        compress_ape=cast(rd.get(p + "index_kpool_compress_ape", (cfg.index_kpool, Di)), acc),
        select_pools=cfg.index_select_pools, select_tail=cfg.index_kpool_always_select_tail,
        rope_dim=cfg.qk_rope_head_dim, rope_interleave=cfg.indexer_rope_interleave, fp8=ctx.numerics.fp8_indexer,
    )


def _mlp(ctx: _Load, p: str, inter: int, key: str) -> MlpWeights:
    rd, cfg, rank, tp, cast = ctx.rd, ctx.cfg, ctx.rank, ctx.tp, ctx.cast
    hid = cfg.hidden_size
    part = _split(inter, tp, key, cfg)
    cols = slice(rank * part, (rank + 1) * part)
    if rd.is_fp8(p + "gate_proj.weight"):
        check_mlp_blocks(ctx, inter, part, key)
        if ctx.numerics.fp8_activations:
            return fp8_mlp(ctx, p, inter, part)
    return MlpWeights(cast(rd.get(p + "gate_proj.weight", (inter, hid))[cols]),
                      cast(rd.get(p + "up_proj.weight", (inter, hid))[cols]),
                      cast(rd.get(p + "down_proj.weight", (hid, inter))[:, cols]))


def _moe(ctx: _Load, p: str) -> MoeWeights:
    rd, cfg, cast, acc = ctx.rd, ctx.cfg, ctx.cast, ctx.acc
    E, hid = cfg.n_routed_experts, cfg.hidden_size
    if rd.get_fp8(f"{p}experts.0.gate_proj.weight", (cfg.moe_intermediate_size, hid)) is not None:
        gate, up, down = fp8_experts(ctx, p, _split(cfg.moe_intermediate_size, ctx.tp, "moe_intermediate_size", cfg))
    else:
        experts = [_mlp(ctx, f"{p}experts.{e}.", cfg.moe_intermediate_size, "moe_intermediate_size") for e in range(E)]
        gate, up, down = (torch.stack([getattr(e, x) for e in experts]) for x in ("gate", "up", "down"))
    shared = None
    if cfg.n_shared_experts > 0:
        shared = _mlp(ctx, p + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts,
                      "moe_intermediate_size * n_shared_experts")
    return MoeWeights(
        router=cast(rd.get(p + "gate.weight", (E, hid)), acc),
        bias=cast(rd.get(p + "gate.e_score_correction_bias", (E,)), acc),
        gate=gate, up=up, down=down, shared=shared, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
        topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
    )
