"""`qual generate`: greedy (or seeded) generation from the embedded runtime, for debugging and oracles."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as checked_dataclass

from qual.cli.main import app
from qual.corpus.records import MAX_TOKENS
from qual.errors import QualError
from qual.files import write_text
from qual.options import (DEFAULT_DEVICE, DEFAULT_DRAFT_KV, DEFAULT_DTYPE, DEFAULT_TEMPERATURE, DEVICES,
                          DSA_TOPK_MODES, DTYPES, MAX_SEED, NUMERICS, Device, DsaTopk, Dtype, Numerics, check_layout)
from qual.records import ArmConfig, EngineRequest, Sampling
from qual.userfiles import load_json, read_text
from qual.validation import parse_flags

MAX_PROMPTS_BYTES = 64 << 20


@checked_dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid", allow_inf_nan=False))
class GenerateOptions:
    """`qual generate`'s options, validated with the run options' vocabulary (qual.options)."""

    tp: int = Field(1, ge=1)
    dcp: int = Field(1, ge=1)
    max_tokens: int = Field(64, ge=1, le=MAX_TOKENS)
    dtype: Dtype = DEFAULT_DTYPE
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    device: Device = DEFAULT_DEVICE
    dsa_topk: DsaTopk | None = None  # None: the engine's default, where the target has sparse attention
    numerics: Numerics | None = None  # None: the engine's default, where the target models vLLM's numerics


def read_prompts(path: Path, tokenizer_dir: str) -> list[tuple[str, list[int]]]:
    """JSONL lines {"id", "prompt"} (tokenized with the target's tokenizer) or {"id", "prompt_token_ids"}."""
    try:
        lines = read_text(path, MAX_PROMPTS_BYTES, "prompts file").splitlines()
    except OSError as exc:
        raise QualError(f"--prompts {path}: unreadable ({exc.strerror or exc})") from None
    out, seen, tokenizer = [], set(), None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = load_json(line, str(path), n)  # bounded: deep nesting, huge numbers, repeated keys are refused
        if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not row["id"]:
            raise QualError(f"{path}:{n}: expected an object with a non-empty string \"id\"")
        unknown = set(row) - {"id", "prompt", "prompt_token_ids"}
        if {"images", "image", "multi_modal_data"} & unknown:
            raise QualError(f"{path}:{n}: image inputs are not supported (text only; a target's vision tower is not loaded)")
        if unknown or ("prompt" in row) == ("prompt_token_ids" in row):
            raise QualError(f"{path}:{n}: expected exactly one of \"prompt\" or \"prompt_token_ids\" beside \"id\" "
                            f"(got keys {sorted(row)})")
        if row["id"] in seen:
            raise QualError(f"{path}:{n}: duplicate id {row['id']!r}")
        seen.add(row["id"])
        if "prompt" in row:
            if not isinstance(row["prompt"], str):
                raise QualError(f"{path}:{n}: \"prompt\" must be a string")
            if tokenizer is None:
                from qual.tokenize import PromptTokenizer

                tokenizer = PromptTokenizer(tokenizer_dir)
            ids = tokenizer.encode(row["prompt"])
        else:
            ids = row["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise QualError(f"{path}:{n}: \"prompt_token_ids\" must be a list of non-negative integers")
        if not ids:
            raise QualError(f"{path}:{n}: request {row['id']!r} has no prompt tokens")
        out.append((row["id"], ids))
    if not out:
        raise QualError(f"--prompts {path}: no requests")
    return out


def _speculative_tokens(draft: Path | None) -> int:
    """K: the drafter's block less its last token (what the runtime takes without a profile), 0 without one."""
    if draft is None:
        return 0
    from qual.checkpoints.config import read_config
    from qual.checkpoints.dflash import DFlashConfig

    return DFlashConfig.from_json(read_config(draft), draft).block_size - 1


@app.command("generate")
def generate_command(
    target: Path = typer.Option(..., "--target", metavar="DIR", help="Target checkpoint directory (any architecture "
                                "the runtime supports)."),
    draft: Optional[Path] = typer.Option(None, "--draft", metavar="DIR", help="Drafter checkpoint directory "
                                         "(speculative decoding)."),
    prompts: Path = typer.Option(..., "--prompts", metavar="FILE", help="JSONL: {\"id\", \"prompt\"} or {\"id\", "
                                 "\"prompt_token_ids\"}."),
    tp: int = typer.Option(1, "--tp", metavar="N", help="Tensor-parallel ranks."),
    dcp: int = typer.Option(1, "--dcp", metavar="N", help="Decode-context-parallel ranks (a divisor of --tp)."),
    max_tokens: int = typer.Option(64, "--max-tokens", metavar="N", help="Most new tokens a request generates."),
    dtype: str = typer.Option(DEFAULT_DTYPE, "--dtype", metavar="|".join(DTYPES), help="Floating-point type to "
                              "compute in."),
    temperature: float = typer.Option(DEFAULT_TEMPERATURE, "--temperature", metavar="T",
                                      help="0: greedy; else sampling seeded by --seed."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seeds sampling (temperature above 0)."),
    device: str = typer.Option(DEFAULT_DEVICE, "--device", metavar="|".join(DEVICES), help="Where it runs."),
    dsa_topk: Optional[str] = typer.Option(None, "--dsa-topk", metavar="|".join(DSA_TOPK_MODES),
                                           help="Sparse-attention targets under DCP (default: the first)."),
    numerics: Optional[str] = typer.Option(None, "--numerics", metavar="|".join(NUMERICS),
                                           help="How a GLM-5 target computes (default: the first; docs/glm5.md, "
                                           "\"Numerics\")."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="FILE", help="Write the JSON lines here instead of "
                                       "stdout."),
) -> None:
    """Generate from the embedded runtime: one JSON line per request, {"id", "prompt_token_ids", "output_token_ids"}.

    Greedy decoding stops at EOS only where the target's config names one; otherwise at --max-tokens.
    """
    from qual.engines.registry import get_engine

    o = parse_flags(GenerateOptions, tp=tp, dcp=dcp, max_tokens=max_tokens, dtype=dtype, temperature=temperature,
                    seed=seed, device=device, dsa_topk=dsa_topk, numerics=numerics)
    check_layout(o.tp, o.dcp)
    rows = read_prompts(prompts, str(target))
    k = _speculative_tokens(draft)
    arm = ArmConfig(engine="reference", model=target.name, dcp=o.dcp, tp=o.tp, draft_kv=DEFAULT_DRAFT_KV,
                    target_path=str(target), draft_path=str(draft) if draft else None, num_speculative_tokens=k,
                    sampling=Sampling(o.temperature, o.seed, o.max_tokens), dtype=o.dtype, device=o.device,
                    extra={"max_model_len": max(len(ids) for _, ids in rows) + o.max_tokens + k + 1},
                    dsa_topk=o.dsa_topk, numerics=o.numerics)
    engine = get_engine(arm.engine)
    arm = engine.preflight(arm, frozenset({"dsa_topk"} if o.dsa_topk else ()))
    for note in engine.notes(arm):
        print(f"warning: {note}", file=sys.stderr)
    results = engine.generate(arm, [EngineRequest(rid, "default", tuple(ids), o.max_tokens) for rid, ids in rows])
    text = "".join(json.dumps(r) + "\n" for r in results)
    if out is None:
        print(text, end="")
        return
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QualError(f"--out {out}: cannot write ({exc.strerror or exc})") from None
    write_text(out, text)  # a failed write is one line naming the file (exit 2)
