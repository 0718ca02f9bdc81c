"""GLM-5.3-Flash text-stack configuration parsed from a checkpoint's config.json (transformers' defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qual.checkpoints.config import check_kinds
from qual.checkpoints.fp8 import BlockFp8, parse_quantization
from qual.errors import QualError
from qual.runtime.models.glm5.schedule import INDEXED, LINEAR, linear_attention, schedule
from qual.userfiles import MAX_CONFIG_BYTES, read_json

# transformers' Glm5NextTextConfig defaults, applied to keys the file leaves out.
_DEFAULTS = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 288, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "pad_token_id": 154820, "bos_token_id": None, "eos_token_id": None, "tie_word_embeddings": False,
    "mlp_layer_types": None, "attention_bias": False, "index_topk": 2048, "index_head_dim": 128,
    "index_n_heads": 32, "layer_types": None, "indexer_types": None, "swiglu_limit": 10.0,
    "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0,
    "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "index_kpool": 16, "index_kpool_always_select_tail": True,
    "max_position_embeddings": 1048576,
}

# Keys read by the parser (their values are validated below).
_IMPLEMENTED = set(_DEFAULTS) | {
    "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset",  # indexer_types schedule forms
    "linear_attn_config",  # Kimi-style dict form of the linear_* keys
    # vLLM's keys (the real checkpoint carries them; transformers knows none): hyper-connections on or off, RoPE in
    # MLA on or off, the indexer's rotary layout; and the RoPE parameters both rotations use
    "mhc", "mla_use_nope", "indexer_rope_interleave", "rope_theta", "rope_parameters", "rope_scaling",
    "quantization_config",  # FP8 block scales (qual/checkpoints/fp8.py); any other method is refused there
}

# Keys accepted without effect on inference, each with the reason.
_INERT = {
    "model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path",  # metadata
    "initializer_range", "router_aux_loss_coef", "output_router_logits",  # training only
    "attention_dropout",  # dropout is off at inference
    "use_cache",  # a generate() switch
    "head_dim",  # transformers overwrites it with qk_rope_head_dim (0 here); nothing reads it
    "qk_head_dim",  # derived (nope + rope), recomputed here
    "num_nextn_predict_layers",  # MTP layers sit past num_hidden_layers; they are not part of the text stack
    "scoring_func", "topk_method",  # DeepSeek-style router names; only the implemented values pass
}

# Top level of a glm5_next (multimodal) config.json, besides text_config / vision_config.
_TOP_LEVEL = {
    "model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
    "text_config", "vision_config", "tie_word_embeddings", "quantization_config",
    # placeholder ids of image/video inputs: only the (skipped) vision tower reads them
    "image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
    "video_start_token_id", "video_end_token_id",
}


@dataclass(frozen=True, slots=True)
class Glm5Config:
    """The GLM-5.3-Flash text stack (KDA + MLA/DSA layers, MoE, MHC), every derived schedule resolved."""

    source: str  # the config.json it came from (named in error messages)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" (KDA) | "indexed_attention" (MLA + DSA)
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse"
    indexer_types: tuple[str, ...]  # "full" | "shared", read for indexed layers only
    rms_norm_eps: float
    tie_word_embeddings: bool
    # MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # DSA indexer
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    index_kpool: int
    index_kpool_always_select_tail: bool
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    linear_lower_bound: float | None  # None: the softplus decay form
    # MLPs
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    # MHC
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    # vLLM's forms (docs/glm5.md, "Keys of the real checkpoint")
    mhc: bool  # hyper-connection streams (False: one residual stream, pre-norm blocks, no hc_* weights)
    mla_rope: bool  # MLA rotates its last qk_rope_head_dim query dims and a shared key (not mla_use_nope)
    indexer_rope_interleave: bool  # the indexer's first qk_rope_head_dim dims rotate as pairs (else rotate-half)
    rope_theta: float
    quantization: BlockFp8 | None  # FP8 block-quantized weights (quantization_config), else None
    eos_token_id: tuple[int, ...]
    pad_token_id: int | None
    vision_skipped: bool  # a vision tower is configured; it is not run (text only)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attention_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def mla_rope_dim(self) -> int:
        """Rotated dims of an MLA key (its shared k_pe, cached beside the latent): 0 under NoPE."""
        return self.qk_rope_head_dim if self.mla_rope else 0

    @property
    def index_select_pools(self) -> int:
        """Pools the indexer selects per query (index_topk tokens' worth)."""
        return self.index_topk // self.index_kpool


def load_glm5_config(path: str | Path) -> Glm5Config:
    """Parse <checkpoint>/config.json (glm5_next_text, or glm5_next nested or flat)."""
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.is_file():
        raise QualError(f"checkpoint {path} has no config.json")
    try:
        raw = read_json(cfg_path, MAX_CONFIG_BYTES, "config.json")
    except OSError as exc:
        raise QualError(f"{cfg_path}: unreadable ({exc.strerror or exc})") from None
    if not isinstance(raw, dict):
        raise QualError(f"{cfg_path}: expected a JSON object")
    return parse_glm5_config(raw, str(cfg_path))


def parse_glm5_config(raw: dict, where: str) -> Glm5Config:
    """The text stack of a config.json dict; `where` names the file in errors."""
    kind = raw.get("model_type")
    if kind == "glm5_next_text":
        return _parse_text(raw, where, vision=False, tie=raw.get("tie_word_embeddings", False))
    quant = raw.get("quantization_config")  # vLLM reads it at the top level first, then inside text_config
    if kind != "glm5_next":
        raise QualError(f"{where}: model_type must be 'glm5_next_text' or 'glm5_next' (got {kind!r})")
    vision = raw.get("vision_config") is not None
    # The composite model ties lm_head by its own top-level flag (transformers reads config.tie_word_embeddings).
    tie = raw.get("tie_word_embeddings", False)
    text = raw.get("text_config")
    if text is not None:
        unknown = sorted(set(raw) - _TOP_LEVEL)
        if unknown:
            raise QualError(f"{where}: unsupported top-level key {unknown[0]!r} (not implemented)")
        if not isinstance(text, dict):
            raise QualError(f"{where}: text_config must be an object")
        if text.get("model_type", "glm5_next_text") != "glm5_next_text":
            raise QualError(f"{where}: text_config.model_type must be 'glm5_next_text' "
                            f"(got {text.get('model_type')!r})")
        if quant is not None and "quantization_config" not in text:
            text = {**text, "quantization_config": quant}
        return _parse_text(text, where + " text_config", vision, tie)
    # Flat text-only form: the text fields sit at the top level next to the multimodal ones.
    flat = {k: v for k, v in raw.items()
            if k not in _TOP_LEVEL or k in ("model_type", "tie_word_embeddings", "quantization_config")}
    return _parse_text(flat, where, vision, tie)


def _rope(text: dict, where: str) -> tuple[bool, bool, float]:
    """(mla_rope, indexer_rope_interleave, rope_theta) as vLLM's glm5next reads them.

    qk_rope_head_dim R > 0 rotates the indexer's first R query/key dims always, and MLA's last R query dims and its
    shared key unless mla_use_nope (then k_pe is zero and those query dims add nothing). vLLM reads both flags
    without a default, so a config with R > 0 must carry them; transformers refuses R > 0 altogether.
    """
    R = int(text.get("qk_rope_head_dim", _DEFAULTS["qk_rope_head_dim"]))
    nope, interleave = text.get("mla_use_nope"), text.get("indexer_rope_interleave")
    for key, value in (("mla_use_nope", nope), ("indexer_rope_interleave", interleave), ("mhc", text.get("mhc"))):
        if value is not None and not isinstance(value, bool):
            raise QualError(f"{where}: {key} must be true or false (got {value!r})")
    if R < 0 or R % 2:
        raise QualError(f"{where}: qk_rope_head_dim={R} must be an even number >= 0 (rotary pairs)")
    if R == 0 and nope is False:
        raise QualError(f"{where}: mla_use_nope=false with qk_rope_head_dim=0: no dims to rotate (vLLM builds a 0-dim "
                        f"RoPE and fails on it)")
    if R > 0:
        for key, value in (("mla_use_nope", nope), ("indexer_rope_interleave", interleave)):
            if value is None:
                raise QualError(f"{where}: qk_rope_head_dim={R} needs {key} (vLLM reads it with no default; "
                                f"transformers runs NoPE only)")
        if R > int(text.get("index_head_dim", _DEFAULTS["index_head_dim"])):
            raise QualError(f"{where}: qk_rope_head_dim={R} exceeds index_head_dim (the indexer rotates its first R dims)")
    theta = text.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise QualError(f"{where}: {key} must be an object (got {rope!r})")
        kind = rope.get("rope_type", rope.get("type", "default"))
        # Scaled RoPE (vLLM rewrites any other type to deepseek_yarn, which also rescales MLA's softmax): not done.
        if kind != "default":
            raise QualError(f"{where}: {key} of type {kind!r} is not implemented (default RoPE only)")
        extra = sorted(set(rope) - {"rope_type", "type", "rope_theta"})
        if extra:
            raise QualError(f"{where}: {key}.{extra[0]} is not implemented (default RoPE over all rotated dims only)")
        theta = rope.get("rope_theta", theta)
    if theta is None:
        if R > 0 and not nope:  # vLLM asserts rope_parameters for a rotating MLA
            raise QualError(f"{where}: MLA RoPE (qk_rope_head_dim={R}, mla_use_nope=false) needs rope_theta or "
                            f"rope_parameters.rope_theta")
        theta = 10000.0  # vLLM's get_rope default: the indexer's rotation when no parameters are given
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise QualError(f"{where}: rope_theta must be a positive number (got {theta!r})")
    return R > 0 and not nope, bool(interleave), float(theta)


def _parse_text(text: dict, where: str, vision: bool, tie) -> Glm5Config:
    for key in text:
        if key not in _IMPLEMENTED and key not in _INERT:
            raise QualError(f"{where}: unsupported key {key!r} (not implemented)")
    check_kinds(text, _DEFAULTS, where)  # every value read as written, never coerced
    get = lambda k: text.get(k, _DEFAULTS[k])  # noqa: E731

    def refuse_unless(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise QualError(f"{where}: {key}={text.get(key, _DEFAULTS.get(key))!r} is not implemented ({why})")

    refuse_unless(get("hidden_act") == "silu", "hidden_act", "only silu")
    refuse_unless(get("attention_bias") is False, "attention_bias", "MLA projections without bias only")
    refuse_unless(get("q_lora_rank") is not None, "q_lora_rank", "the DSA indexer reads the q_lora residual")
    refuse_unless(text.get("scoring_func", "sigmoid") == "sigmoid", "scoring_func", "sigmoid router only")
    refuse_unless(text.get("topk_method", "noaux_tc") == "noaux_tc", "topk_method", "biased grouped top-k only")
    refuse_unless(get("swiglu_limit") is not None, "swiglu_limit", "the clamped SwiGLU needs a limit")
    mla_rope, indexer_interleave, theta = _rope(text, where)

    n = int(get("num_hidden_layers"))
    heads = int(get("num_attention_heads"))
    kv_heads = text.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else int(kv_heads)
    if kv_heads != heads:
        raise QualError(f"{where}: constraint num_attention_heads == num_key_value_heads violated "
                        f"({heads} != {kv_heads})")
    kpool, topk = int(get("index_kpool")), int(get("index_topk"))
    if kpool < 1:
        raise QualError(f"{where}: index_kpool must be >= 1 (got {kpool})")
    if topk % kpool:
        raise QualError(f"{where}: constraint index_topk % index_kpool == 0 violated ({topk} % {kpool})")
    # Without the tail, a query before its first complete pool selects nothing; transformers then attends
    # uniformly over every key (future ones included) and vLLM refuses the setting.
    if kpool > 1 and not get("index_kpool_always_select_tail"):
        raise QualError(f"{where}: index_kpool_always_select_tail=false is not implemented (with index_kpool > 1)")

    layers, mlp, idx = schedule(text, n)
    for key, values, allowed in (("layer_types", layers, (LINEAR, INDEXED)),
                                 ("mlp_layer_types", mlp, ("dense", "sparse")),
                                 ("indexer_types", idx, ("full", "shared"))):
        if len(values) != n:
            raise QualError(f"{where}: {key} has {len(values)} entries for num_hidden_layers={n}")
        bad = [v for v in values if v not in allowed]
        if bad:
            raise QualError(f"{where}: {key} value {bad[0]!r} is not one of {', '.join(allowed)}")
    lin = linear_attention(text, where, _DEFAULTS)
    if int(lin["linear_conv_kernel_dim"]) < 1:
        raise QualError(f"{where}: linear_conv_kernel_dim must be >= 1")

    experts, group, topk_group = int(get("n_routed_experts")), int(get("n_group")), int(get("topk_group"))
    if "sparse" in mlp:
        # transformers scores a group by its two best experts, so a group needs two of them.
        if group < 1 or experts % group or experts // group < 2:
            raise QualError(f"{where}: constraint n_routed_experts % n_group == 0 with >= 2 experts per group violated "
                            f"({experts} experts, n_group={group})")
        if not 1 <= topk_group <= group:
            raise QualError(f"{where}: constraint 1 <= topk_group <= n_group violated ({topk_group}, {group})")
        if not 1 <= int(get("num_experts_per_tok")) <= topk_group * (experts // group):
            raise QualError(f"{where}: num_experts_per_tok={get('num_experts_per_tok')} exceeds the experts of "
                            f"topk_group={topk_group} groups")
    if int(get("hc_mult")) < 1:
        raise QualError(f"{where}: hc_mult must be >= 1 (got {get('hc_mult')})")

    eos = get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    lb = lin["linear_lower_bound"]
    cfg = Glm5Config(
        source=where, vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")), num_hidden_layers=n,
        layer_types=tuple(layers), mlp_layer_types=tuple(mlp), indexer_types=tuple(idx),
        rms_norm_eps=float(get("rms_norm_eps")), tie_word_embeddings=bool(tie),
        num_attention_heads=heads, q_lora_rank=int(get("q_lora_rank")), kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=int(get("qk_nope_head_dim")), qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")),
        index_topk=topk, index_head_dim=int(get("index_head_dim")), index_n_heads=int(get("index_n_heads")),
        index_kpool=kpool, index_kpool_always_select_tail=bool(get("index_kpool_always_select_tail")),
        linear_num_heads=int(lin["linear_num_heads"]), linear_head_dim=int(lin["linear_head_dim"]),
        linear_conv_kernel_dim=int(lin["linear_conv_kernel_dim"]), linear_lower_bound=None if lb is None else float(lb),
        intermediate_size=int(get("intermediate_size")), moe_intermediate_size=int(get("moe_intermediate_size")),
        n_routed_experts=experts, n_shared_experts=int(get("n_shared_experts")),
        num_experts_per_tok=int(get("num_experts_per_tok")), n_group=group, topk_group=topk_group,
        norm_topk_prob=bool(get("norm_topk_prob")), routed_scaling_factor=float(get("routed_scaling_factor")),
        swiglu_limit=float(get("swiglu_limit")), hc_mult=int(get("hc_mult")), hc_eps=float(get("hc_eps")),
        hc_sinkhorn_iters=int(get("hc_sinkhorn_iters")), mhc=bool(text.get("mhc", True)), mla_rope=mla_rope,
        indexer_rope_interleave=indexer_interleave, rope_theta=theta,
        quantization=parse_quantization(text.get("quantization_config"), where), eos_token_id=eos, pad_token_id=get("pad_token_id"),
        vision_skipped=vision,
    )
    for i in range(n):
        if layers[i] == INDEXED and idx[i] == "shared" and (i == 0 or layers[i - 1] != INDEXED or idx[i - 1] != "full"):
            before = "nothing" if i == 0 else f"a {'shared ' if layers[i - 1] == INDEXED else ''}{layers[i - 1]} layer"
            raise QualError(f"{where}: indexer_types[{i}]='shared' follows {before}: a shared layer reuses the top-k of "
                            f"the full indexed_attention layer right before it (transformers raises otherwise; "
                            f"vLLM 0.32 ignores indexer_types)")
    return cfg
