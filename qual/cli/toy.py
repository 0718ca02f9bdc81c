"""`qual toy`: train (reproduce) and verify the toy Qwen3 target + DFlash drafter pair."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from qual.cli.main import app
from qual.errors import QualError
from qual.paths import DATA_DIR

TOY_DIR = DATA_DIR / "models" / "toy"  # the shipped pair

toy_app = typer.Typer(no_args_is_help=True, help=__doc__)
app.add_typer(toy_app, name="toy")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@toy_app.command("train")
def train(
    device: Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda when available)")] = None,
    out: Annotated[Optional[Path], typer.Option(help="where target/, draft/ and MANIFEST.json are written (default: "
                                                "the preset's shipped pair, qual/data/models/PRESET; with --tiny, "
                                                "WORK/PRESET-tiny)")] = None,
    work: Annotated[Path, typer.Option(help="cache of downloads, tokens and generated data")] = Path(".cache/toy"),
    stages: Annotated[str, typer.Option(help="'all', a comma list, or 'STAGE-' (that stage and the rest)")] = "all",
    tiny: Annotated[bool, typer.Option(help="the preset's architecture at a few steps' size on the same data: a smoke "
                                            "run, not the committed pair")] = False,
    preset: Annotated[str, typer.Option(help="the committed pair to reproduce: toy (Qwen3 + DFlash), glm-toy "
                                             "(GLM-5.3-Flash-shaped target + DFlash2) or glm-toy-vllm (glm-toy "
                                             "grown to vLLM's shapes, FP8)")] = "toy",
    refresh_data: Annotated[bool, typer.Option(help="redo fetch/tokenizer/tokenize even when cached")] = False,
    target_steps: Annotated[Optional[int], typer.Option(help="override the target's training steps")] = None,
    draft_steps: Annotated[Optional[int], typer.Option(help="override the drafter's training steps")] = None,
    num_prompts: Annotated[Optional[int], typer.Option(help="override the number of generation prompts")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override any TrainConfig field: FIELD=VALUE or "
                                                      "shape.FIELD=VALUE (tuples as comma lists); repeatable")] = None,
) -> None:
    """Reproduce the toy pair: fetch data, tokenizer, tokenize, train target, generate, train drafter, eval, manifest."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:  # the trainer's models are transformers' (the dev extra)
        raise QualError("qual toy train needs transformers, which is not installed: pip install 'qual[dev]' "
                        "(or pip install 'transformers>=4.51')")
    from qual.toy.config import PRESETS, apply_overrides
    from qual.toy.pipeline import parse_stages, run

    dev = device or _default_device()
    if dev not in ("cuda", "cpu") and not dev.startswith("cuda:"):
        raise QualError(f"--device must be cuda or cpu (got {dev!r})")
    if preset not in PRESETS:
        raise QualError(f"--preset must be one of {', '.join(PRESETS)} (got {preset!r})")
    full, smoke = PRESETS[preset]
    cfg = smoke() if tiny else full()
    # a smoke run never lands on a shipped pair unless --out says so
    out = out or (work / f"{preset}-tiny" if tiny else DATA_DIR / "models" / preset)
    if target_steps is not None:
        cfg.target_steps = target_steps
    if draft_steps is not None:
        cfg.draft_steps = draft_steps
    if num_prompts is not None:
        cfg.num_prompts = num_prompts
    apply_overrides(cfg, set_ or [])
    run(cfg, out, work, dev, parse_stages(stages), refresh_data=refresh_data,
        log=lambda msg: print(msg, flush=True), preset=preset)


@toy_app.command("verify")
def verify(out: Annotated[Path, typer.Option(help="the toy model dir")] = TOY_DIR) -> None:
    """Check every file's sha256 against MANIFEST.json."""
    from qual.toy.manifest import MANIFEST, verify_manifest

    if not (out / MANIFEST).exists():
        raise QualError(f"{out / MANIFEST}: not found")
    bad = verify_manifest(out)
    if bad:
        raise QualError(f"{out}: sha256 mismatch or missing for {', '.join(bad)}")
    print(f"{out}: all files match {MANIFEST}")
