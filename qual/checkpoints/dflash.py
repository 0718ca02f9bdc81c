"""The public DFlash / DFlash2 drafter format (what vLLM's qwen3_dflash / qwen3_dflash2 loaders read).

See docs/dflash.md. Weights carry no `model.` prefix: fc, hidden_norm, norm, layers.i.*, and for DFlash2
layers.i.{attention,mlp}_conv.* and candidate_selector.*; the embedding and LM head are the target's unless the
checkpoint ships its own.

Every key of config.json and of its dflash_config is either read (ACCEPTED, with what it does here) or refused by
name (REFUSED, with why); a key in neither table is refused as unknown. tests/test_dflash_against_vllm.py takes the
keys vLLM's loaders read from the installed vLLM's own source and checks each is in one of the tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from qual.checkpoints.config import field, read_config, true_or_false
from qual.checkpoints.io import save_checkpoint
from qual.checkpoints.qwen3 import MODEL_TYPE, Qwen3Config, layer_weight_shapes, random_layer
from qual.errors import QualError
from qual.validation import shown

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_2 = "DFlash2DraftModel"  # DFlash layers + grouped causal convolutions + a candidate selector
ARCHITECTURES = (ARCHITECTURE, ARCHITECTURE_2)
LAYER_TYPES = ("full_attention", "sliding_attention")
SLIDING = "sliding_attention"
MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default: layers below it stay full when layer_types is absent

# Top-level config.json keys the format reads. Shapes and norms are the usual Qwen3 fields.
ACCEPTED = {
    "architectures": "DFlashDraftModel or DFlash2DraftModel: which drafter runs",
    "model_type": "must be qwen3: vLLM builds transformers' Qwen3Config for it, whose defaults fill absent keys",
    "vocab_size": "shape", "hidden_size": "shape", "intermediate_size": "shape", "num_hidden_layers": "shape",
    "num_attention_heads": "shape", "num_key_value_heads": "shape", "head_dim": "shape (absent: 128, as transformers)",
    "rms_norm_eps": "every RMSNorm's epsilon",
    "max_position_embeddings": "longest position RoPE is asked for",
    "hidden_act": "silu only (vLLM's DFlash MLP refuses any other)",
    "attention_bias": "q/k/v/o projection biases (the context K/V projection carries the k/v ones)",
    "rope_theta": "RoPE base (transformers' precedence: rope_parameters.rope_theta, then this, then 10000)",
    "rope_parameters": "RoPE type and base: the default type only; other types are refused by name",
    "rope_scaling": "legacy RoPE type: replaces rope_parameters (transformers); non-default types are refused",
    "use_sliding_window": "transformers drops sliding_window unless this is true",
    "sliding_window": "window of sliding layers (after use_sliding_window; dflash_config.swa_window_size wins)",
    "max_window_layers": "with no layer_types, layers from this index on slide (transformers' default)",
    "layer_types": "per layer full_attention / sliding_attention",
    "is_causal": "overrides every layer's causality (vLLM reads it before dflash_config.causal)",
    "is_neox_style": "RoPE layout: true rotate-half (default), false interleaved pairs",
    "add_swa_attention_sink_bias": "per-head attention sink logits (read when dflash_config has no attention_sink_bias)",
    "mask_token_id": "the mask token when dflash_config has none",
    "eagle_aux_hidden_state_layer_ids": "aux hidden-state ids (target layer + 1); vLLM reads them before target_layer_ids",
    "target_layer_ids": "target layers when dflash_config has none (vLLM's fallback)",
    "block_size": "the last token plus at most block_size - 1 drafts (vLLM takes K from its speculative config)",
    "num_target_layers": "checked against the target",
    "dflash_config": "the drafter's own keys (DFLASH_ACCEPTED)",
    "draft_vocab_size": "must equal vocab_size: a draft-to-target vocabulary map (d2t) is refused",
    "target_hidden_size": "must equal hidden_size: fc reads hidden_size-wide aux states",
    "logit_scale": "scales draft logits: positive, so the greedy pick (DFlash) is unchanged; DFlash2 never reads it",
    "has_own_lm_head": "true needs lm_head.weight in the checkpoint (used as the drafter's LM head)",
    "use_aux_hidden_state": "must be true: the drafter conditions on target aux hidden states through fc",
    # Bookkeeping and training-time keys: no effect on a forward pass.
    "tie_word_embeddings": "not read by vLLM's DFlash: its LM head is the target's or the checkpoint's lm_head",
    "bos_token_id": "tokenizer's", "eos_token_id": "tokenizer's", "pad_token_id": "tokenizer's",
    "torch_dtype": "storage dtype (the engine's dtype decides)", "dtype": "storage dtype (the engine's dtype decides)",
    "transformers_version": "bookkeeping", "_name_or_path": "bookkeeping", "initializer_range": "training only",
    "use_cache": "generation bookkeeping", "attention_dropout": "training only (0 at inference)",
    "output_hidden_states": "bookkeeping", "return_dict": "bookkeeping", "chunk_size_feed_forward": "same math",
    "is_encoder_decoder": "must be false", "id2label": "bookkeeping", "label2id": "bookkeeping",
    "problem_type": "bookkeeping",
}

# Keys refused by name when set (null, false or empty pass: nothing to honour); the value says why.
REFUSED = {
    "eagle_config": "vLLM merges it under dflash_config; write those keys in dflash_config",
    "quantization_config": "quantized drafters are not supported",
    "speculators_model_type": "speculators-format checkpoints are not read; convert to the public DFlash format",
    "speculators_config": "speculators-format checkpoints are not read",
    "transformer_layer_config": "speculators-format checkpoints are not read",
    "dspark_target_layer_ids": "a DSpark drafter's key",
    "dspark_noise_token_id": "a DSpark drafter's key",
    "pard_token": "a PARD drafter's key",
    "ptd_token_id": "a PTD drafter's key",
}

# dflash_config keys.
DFLASH_ACCEPTED = {
    "mask_token_id": "token id of the block's mask slots",
    "target_layer_ids": "target layers whose outputs condition the drafter (0-based; aux hidden state i + 1)",
    "layer_ids": "aux hidden-state ids (target layer + 1): vLLM's last fallback for the conditioning layers",
    "causal": "overrides every layer's causality inside the block",
    "use_swa": "every layer slides when layer_types has no sliding layer",
    "swa_window_size": "window of sliding layers (read before the top-level sliding_window)",
    "attention_sink_bias": "per-head attention sink logits (layers.i.self_attn.attention_sink_bias)",
    "attention_value_scale": "scales every V (context and block) before attention",
    "use_aux_hidden_state": "must be true (see the top-level key)",
    "sample_from_anchor": "must be false: the anchor is the bonus token (vLLM refuses true for DFlash)",
    # DFlash2 only (DFLASH2_KEYS): a DFlash drafter carrying one is refused, vLLM's DFlash loader would ignore it.
    "conv_kernel_size": "DFlash2: taps of the grouped causal convolutions",
    "conv_group_size": "DFlash2: channels per convolution group (divides hidden_size)",
    "selector_rank": "DFlash2: rank of the candidate selector's codebooks",
    "selector_top_k": "DFlash2: candidates per draft position",
    "input_embedding_scale": "DFlash2: scales the block's input embeddings",
    "output_multiplier": "DFlash2: scales the candidates' logits (positive: vLLM's top-k needs it)",
    "final_logit_softcapping": "DFlash2: soft cap of the candidates' logits (<= 0 or null: none, as vLLM)",
}
DFLASH_REFUSED: dict[str, str] = {}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "input_embedding_scale",
                "output_multiplier", "final_logit_softcapping")
DFLASH2_REQUIRED = DFLASH2_KEYS[:4]

# Tensors a checkpoint may carry besides the drafter's own, and those refused.
OPTIONAL_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
REFUSED_WEIGHTS = {"d2t": "a draft-to-target vocabulary map", "t2d": "a target-to-draft vocabulary map",
                   "mask_hidden": "vLLM refuses a mask_hidden weight (the mask embeds via mask_token_id)"}


@dataclass(frozen=True, slots=True)
class DFlash2Params:
    """What DFlash2 adds to a DFlash drafter."""

    conv_kernel_size: int  # taps
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None: no cap

    def to_json(self) -> dict:
        out = {"conv_kernel_size": self.conv_kernel_size, "conv_group_size": self.conv_group_size,
               "selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k}
        if self.input_embedding_scale != 1.0:
            out["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            out["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            out["final_logit_softcapping"] = self.final_logit_softcapping
        return out


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    """A DFlash (or DFlash2) drafter's config.json, resolved as vLLM resolves it."""

    layers: Qwen3Config  # the draft layers' shapes (attention_bias, rope_theta included)
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None  # window of the sliding layers
    use_swa: bool = False  # dflash_config.use_swa: every layer slides when layer_types names none
    causal: bool | None = None  # is_causal / dflash_config.causal: one causality for every layer (None: by type)
    is_neox_style: bool = True
    value_scale: float | None = None  # dflash_config.attention_value_scale
    attention_sink: bool = False  # dflash_config.attention_sink_bias
    has_own_lm_head: bool = False  # needs lm_head.weight in the checkpoint
    dflash2: DFlash2Params | None = None

    def __post_init__(self):
        if any(self.layer_sliding(i) for i in range(len(self.layer_types))) and not self.sliding_window:
            raise QualError("sliding_attention layers need a window: dflash_config.swa_window_size, or sliding_window "
                            "with use_sliding_window true")

    @property
    def architecture(self) -> str:
        return ARCHITECTURE_2 if self.dflash2 else ARCHITECTURE

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose outputs condition the drafter, in the order their features are concatenated
        into fc: ascending, whatever order the config lists them in (vLLM keeps its aux layers as a sorted set)."""
        return tuple(sorted(self.target_layer_ids))

    def layer_sliding(self, i: int) -> bool:
        """vLLM's rule: use_swa makes every layer slide when layer_types names none; else layer_types decides."""
        if self.use_swa and SLIDING not in self.layer_types:
            return True
        return self.layer_types[i] == SLIDING

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_sliding(i) else None

    def layer_causal(self, i: int) -> bool:
        """is_causal, then dflash_config.causal, else causal exactly for layers typed sliding_attention."""
        return self.causal if self.causal is not None else self.layer_types[i] == SLIDING

    @classmethod
    def from_json(cls, cfg: dict, path: Path) -> "DFlashConfig":
        where = path / "config.json"
        archs = [a for a in cfg.get("architectures") or [] if a in ARCHITECTURES]
        if not archs:
            raise QualError(f"{where}: architectures must include {ARCHITECTURE!r} or {ARCHITECTURE_2!r}")
        _check_keys(cfg, ACCEPTED, REFUSED, "", where)
        if cfg.get("model_type") != MODEL_TYPE:
            raise QualError(f"{where}: model_type must be {MODEL_TYPE!r} (got {cfg.get('model_type')!r})")
        dflash = field(cfg, "dflash_config", path)
        if not isinstance(dflash, dict):
            raise QualError(f"{where}: dflash_config must be an object")
        _check_keys(dflash, DFLASH_ACCEPTED, DFLASH_REFUSED, "dflash_config.", where)
        v2 = archs[0] == ARCHITECTURE_2
        if not v2 and (extra := [k for k in DFLASH2_KEYS if k in dflash]):
            raise QualError(f"{where}: dflash_config.{extra[0]} is a DFlash2 key, but architectures names "
                            f"{ARCHITECTURE} (vLLM's DFlash loader would ignore it)")
        layers = Qwen3Config.from_json(cfg, path)
        _check_values(cfg, dflash, layers, where)
        n = layers.num_hidden_layers

        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None  # transformers drops it
        layer_types = cfg.get("layer_types")
        if layer_types is None:  # transformers' Qwen3Config fills them in
            first = cfg.get("max_window_layers", MAX_WINDOW_LAYERS)
            layer_types = [SLIDING if window is not None and i >= first else "full_attention" for i in range(n)]
        layer_types = tuple(layer_types)
        if len(layer_types) != n or set(layer_types) - set(LAYER_TYPES):
            raise QualError(f"{where}: layer_types must list full_attention/sliding_attention for each of {n} layers")
        if "swa_window_size" in dflash:
            window = dflash["swa_window_size"]
        if window is not None and (not isinstance(window, int) or window < 1):
            raise QualError(f"{where}: the sliding window must be a positive integer (got {window!r})")

        num_target_layers = field(cfg, "num_target_layers", path)
        if not isinstance(num_target_layers, int) or num_target_layers < 2:
            raise QualError(f"{where}: num_target_layers must be an integer >= 2 (got {num_target_layers!r})")
        ids = _target_layer_ids(cfg, dflash, where)
        # The last layer is allowed: its output (before the final norm) is vLLM's aux state num_target_layers.
        if not ids or any(i < 0 or i > num_target_layers - 1 for i in ids):
            raise QualError(f"{where}: target_layer_ids {list(ids)} must be within 0..{num_target_layers - 1}")
        if len(set(ids)) != len(ids):
            raise QualError(f"{where}: target_layer_ids {list(ids)} name a layer twice: vLLM captures each layer once "
                            f"(a sorted set) while fc takes one feature per id, and stops ('DFlash drafter expects "
                            f"{len(ids)} concatenated aux hidden features but received {len(set(ids))}')")
        mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < layers.vocab_size:
            raise QualError(f"{where}: mask_token_id {mask!r} is not a vocabulary id (vocab_size {layers.vocab_size})")
        block_size = field(cfg, "block_size", path)
        if not isinstance(block_size, int) or block_size < 2:
            raise QualError(f"{where}: block_size must be an integer >= 2 (the last token plus at least one draft), "
                            f"got {block_size!r}")
        causal = _flag(cfg, "is_causal", None, where)
        causal = _flag(dflash, "causal", None, where, "dflash_config.") if causal is None else causal
        sink = true_or_false(dflash.get("attention_sink_bias", cfg.get("add_swa_attention_sink_bias", False)),
                             "attention_sink_bias", where)
        value_scale = dflash.get("attention_value_scale")
        if value_scale is not None and (type(value_scale) not in (int, float) or not math.isfinite(value_scale)):
            raise QualError(f"{where}: dflash_config.attention_value_scale: expected a number, got {shown(value_scale)}")
        try:
            return cls(layers, block_size, num_target_layers, mask, ids, layer_types, window,
                       use_swa=_flag(dflash, "use_swa", False, where, "dflash_config."), causal=causal,
                       is_neox_style=_flag(cfg, "is_neox_style", True, where),
                       value_scale=None if value_scale is None else float(value_scale), attention_sink=sink,
                       has_own_lm_head=_flag(cfg, "has_own_lm_head", False, where),
                       dflash2=_dflash2(dflash, layers, where) if v2 else None)
        except QualError as exc:
            raise QualError(f"{where}: {exc}") from None

    def to_json(self) -> dict:
        """config.json in the public format (what vLLM and this module read back to the same config)."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.causal is not None:
            dflash["causal"] = self.causal
        if self.use_swa:
            dflash["use_swa"] = True
        if self.value_scale is not None:
            dflash["attention_value_scale"] = self.value_scale
        if self.attention_sink:
            dflash["attention_sink_bias"] = True
        if self.dflash2:
            dflash.update(self.dflash2.to_json())
        out = {
            **self.layers.to_json(),
            "architectures": [self.architecture],
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
            "layer_types": list(self.layer_types),
            # transformers keeps sliding_window only with use_sliding_window (else vLLM would see no window)
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
        }
        if not self.is_neox_style:
            out["is_neox_style"] = False
        if self.has_own_lm_head:
            out["has_own_lm_head"] = True
        return out


def _flag(cfg: dict, key: str, default: bool | None, where: Path, prefix: str = "") -> bool | None:
    """A true/false key as written (null: the default): "false" or 1 is refused, never coerced."""
    value = cfg.get(key)
    return default if value is None else true_or_false(value, prefix + key, where)


def _check_keys(cfg: dict, accepted: dict, refused: dict, prefix: str, where: Path) -> None:
    for key in cfg:
        if key in refused and cfg[key] in (None, False, {}, []):  # present but empty: nothing to honour
            continue
        if key in refused:
            raise QualError(f"{where}: {prefix}{key} is not supported: {refused[key]}")
        if key not in accepted:
            raise QualError(f"{where}: unknown key {prefix}{key} (a drafter key this runtime does not implement)")


def _check_values(cfg: dict, dflash: dict, layers: Qwen3Config, where: Path) -> None:
    """Accepted keys whose other values would need what the runtime does not implement."""
    def refuse(key: str, why: str):
        raise QualError(f"{where}: {key} {why}")

    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"{cfg['hidden_act']!r} is not supported (silu only, as vLLM's DFlash MLP)")
    if cfg.get("draft_vocab_size") not in (None, layers.vocab_size):
        refuse("draft_vocab_size", f"{cfg['draft_vocab_size']} differs from vocab_size {layers.vocab_size}: "
               "draft-to-target vocabulary maps (d2t) are not supported")
    if cfg.get("target_hidden_size") not in (None, layers.hidden_size):
        refuse("target_hidden_size", f"{cfg['target_hidden_size']} differs from hidden_size {layers.hidden_size}: "
               "the drafter conditions on aux states of its own width")
    scale = cfg.get("logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        refuse("logit_scale", f"{scale!r} is not supported (a positive scale leaves the greedy pick unchanged)")
    for name, value in (("use_aux_hidden_state", cfg.get("use_aux_hidden_state", True)),
                        ("dflash_config.use_aux_hidden_state", dflash.get("use_aux_hidden_state", True))):
        if value is not True:
            refuse(name, f"{value!r} is not supported: the drafter conditions on target aux hidden states")
    if dflash.get("sample_from_anchor", False) is not False:
        refuse("dflash_config.sample_from_anchor", "must be false: the anchor is the bonus token (vLLM refuses true)")
    if cfg.get("is_encoder_decoder", False):
        refuse("is_encoder_decoder", "must be false")
    for key in ("is_causal", "is_neox_style", "use_sliding_window", "add_swa_attention_sink_bias", "has_own_lm_head"):
        _flag(cfg, key, None, where)
    for key in ("causal", "use_swa", "attention_sink_bias"):
        _flag(dflash, key, None, where, "dflash_config.")
    vs = dflash.get("attention_value_scale")
    if vs is not None and (isinstance(vs, bool) or not isinstance(vs, (int, float))):
        refuse("dflash_config.attention_value_scale", f"must be a number (got {vs!r})")


def _target_layer_ids(cfg: dict, dflash: dict, where: Path) -> tuple[int, ...]:
    """Target layers, 0-based, by vLLM's precedence (get_eagle3_aux_layers_from_config): aux ids (= layer + 1) from
    eagle_aux_hidden_state_layer_ids, else dflash_config.target_layer_ids, else the top-level target_layer_ids, else
    aux ids from dflash_config.layer_ids."""
    def ints(key, values):
        if not isinstance(values, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in values):
            raise QualError(f"{where}: {key} must be a list of integers (got {values!r})")
        return tuple(values)

    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(i - 1 for i in ints("eagle_aux_hidden_state_layer_ids", cfg["eagle_aux_hidden_state_layer_ids"]))
    if dflash.get("target_layer_ids"):
        return ints("dflash_config.target_layer_ids", dflash["target_layer_ids"])
    if cfg.get("target_layer_ids"):
        return ints("target_layer_ids", cfg["target_layer_ids"])
    if dflash.get("layer_ids"):
        return tuple(i - 1 for i in ints("dflash_config.layer_ids", dflash["layer_ids"]))
    raise QualError(f"{where}: missing field 'target_layer_ids' (dflash_config.target_layer_ids)")


def _dflash2(dflash: dict, layers: Qwen3Config, where: Path) -> DFlash2Params:
    missing = [k for k in DFLASH2_REQUIRED if k not in dflash]
    if missing:
        raise QualError(f"{where}: {ARCHITECTURE_2} needs dflash_config.{missing[0]}")
    for key in DFLASH2_REQUIRED:
        if isinstance(dflash[key], bool) or not isinstance(dflash[key], int) or dflash[key] < 1:
            raise QualError(f"{where}: dflash_config.{key} must be a positive integer (got {dflash[key]!r})")
    if layers.hidden_size % dflash["conv_group_size"]:
        raise QualError(f"{where}: dflash_config.conv_group_size={dflash['conv_group_size']} must divide "
                        f"hidden_size={layers.hidden_size}")
    if dflash["selector_top_k"] > layers.vocab_size:
        raise QualError(f"{where}: dflash_config.selector_top_k={dflash['selector_top_k']} exceeds vocab_size")
    for key in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        v = dflash.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise QualError(f"{where}: dflash_config.{key} must be a number (got {v!r})")
    mult = float(dflash.get("output_multiplier", 1.0))
    if mult <= 0:  # vLLM's candidate top-k scales after selecting, which only a positive scale allows
        raise QualError(f"{where}: dflash_config.output_multiplier must be positive (got {mult})")
    cap = float(dflash.get("final_logit_softcapping") or 0.0)
    return DFlash2Params(dflash["conv_kernel_size"], dflash["conv_group_size"], dflash["selector_rank"],
                         dflash["selector_top_k"], float(dflash.get("input_embedding_scale", 1.0)), mult,
                         cap if cap > 0 else None)


def read_dflash(path: str | Path) -> DFlashConfig:
    path = Path(path)
    return DFlashConfig.from_json(read_config(path), path)


def weight_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the drafter reads, by its checkpoint name (optional embed_tokens / lm_head aside)."""
    lc = cfg.layers
    hid, H, D, kv = lc.hidden_size, lc.num_attention_heads, lc.head_dim, lc.num_key_value_heads
    shapes = {"fc.weight": (hid, hid * len(cfg.target_layer_ids)), "hidden_norm.weight": (hid,), "norm.weight": (hid,)}
    for i in range(lc.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(layer_weight_shapes(lc, p))
        if lc.attention_bias:
            shapes.update({f"{p}self_attn.q_proj.bias": (H * D,), f"{p}self_attn.k_proj.bias": (kv * D,),
                           f"{p}self_attn.v_proj.bias": (kv * D,), f"{p}self_attn.o_proj.bias": (hid,)})
        if cfg.attention_sink:
            shapes[f"{p}self_attn.attention_sink_bias"] = (H,)
        if cfg.dflash2:
            taps, groups = cfg.dflash2.conv_kernel_size, hid // cfg.dflash2.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"{p}{conv}.base_kernel"] = (2, taps, hid)
                shapes[f"{p}{conv}.kernel_projection.weight"] = (2 * taps * groups, hid)
    if cfg.dflash2:
        r = cfg.dflash2.selector_rank
        shapes.update({"candidate_selector.predecessor_codebook": (lc.vocab_size, r),
                       "candidate_selector.successor_codebook": (lc.vocab_size, r),
                       "candidate_selector.hidden_projection.weight": (r, hid)})
    return shapes


def check_weight_names(cfg: DFlashConfig, names, where) -> None:
    """Every tensor of the checkpoint is one the drafter reads (an unread one would be a silently ignored part)."""
    known = set(weight_shapes(cfg)) | set(OPTIONAL_WEIGHTS)
    for name in sorted(set(names) - known):
        why = next((w for key, w in REFUSED_WEIGHTS.items() if key in name.split(".")[-1] or name.startswith(key)), None)
        if why:
            raise QualError(f"checkpoint {where}: tensor {name!r} is not supported: {why}")
        raise QualError(f"checkpoint {where}: unexpected tensor {name!r} (not part of a {cfg.architecture})")


def random_draft_weights(cfg: DFlashConfig, seed: int = 1, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """A random drafter: fc N(0, scale^2), norms 1, layers as qwen3.random_layer, biases N(0, scale^2); DFlash2's
    base kernels near the identity tap, its kernel projections and codebooks random."""
    g = torch.Generator().manual_seed(seed)
    hid = cfg.layers.hidden_size
    w = {"fc.weight": torch.randn(hid, hid * len(cfg.target_layer_ids), generator=g) * scale,
         "hidden_norm.weight": torch.ones(hid), "norm.weight": torch.ones(hid)}
    for i in range(cfg.layers.num_hidden_layers):
        w.update(random_layer(cfg.layers, f"layers.{i}.", g, scale))
    for name, shape in weight_shapes(cfg).items():
        if name in w:
            continue
        if name.endswith("base_kernel"):  # tap 0 near 1: the block stays close to the plain DFlash function
            t = torch.randn(shape, generator=g) * 0.3
            t[:, 0] += 1.0
        elif "codebook" in name:
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * scale
        w[name] = t
    return w


def write_dflash(path: str | Path, cfg: DFlashConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                 **config_overrides) -> Path:
    """A drafter checkpoint directory (weights cast to dtype when given)."""
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
        config_overrides.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    return save_checkpoint(path, {**cfg.to_json(), **config_overrides}, weights)
