"""`qual generate`: greedy (or seeded) generation from the embedded runtime, for debugging and oracles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from qual.cli.main import app
from qual.errors import QualError

MAX_PROMPTS_BYTES = 64 << 20


def read_prompts(path: Path, tokenizer_dir: str) -> list[tuple[str, list[int]]]:
    """JSONL lines {"id", "prompt"} (tokenized with the target's tokenizer) or {"id", "prompt_token_ids"}."""
    try:
        if path.stat().st_size > MAX_PROMPTS_BYTES:
            raise QualError(f"{path}: larger than {MAX_PROMPTS_BYTES >> 20} MiB")
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise QualError(f"--prompts {path}: unreadable ({exc})") from None
    out, seen, tokenizer = [], set(), None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QualError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
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


@app.command("generate")
def generate_command(
    target: Path = typer.Option(..., "--target", help="Target checkpoint directory (any architecture the runtime supports)."),
    draft: Optional[Path] = typer.Option(None, "--draft", help="Drafter checkpoint directory (speculative decoding)."),
    prompts: Path = typer.Option(..., "--prompts", help="JSONL: {\"id\", \"prompt\"} or {\"id\", \"prompt_token_ids\"}."),
    tp: int = typer.Option(1, "--tp"),
    dcp: int = typer.Option(1, "--dcp"),
    max_tokens: int = typer.Option(64, "--max-tokens"),
    dtype: str = typer.Option("float32", "--dtype", help="float64 | float32 | bfloat16"),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; else sampling seeded by --seed."),
    seed: int = typer.Option(0, "--seed"),
    device: str = typer.Option("cpu", "--device"),
    dsa_topk: str = typer.Option("exact", "--dsa-topk", help="Sparse-attention targets under DCP: exact | union."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the JSON lines here instead of stdout."),
) -> None:
    """Generate from the embedded runtime: one JSON line per request, {"id", "prompt_token_ids", "output_token_ids"}.

    Greedy decoding stops at EOS only where the target's config names one; otherwise at --max-tokens.
    """
    import math

    from qual.engines.registry import engine_class

    if dtype not in ("float64", "float32", "bfloat16"):
        raise QualError(f"--dtype must be float64, float32 or bfloat16 (got {dtype!r})")
    if not math.isfinite(temperature) or temperature < 0:
        raise QualError(f"--temperature must be a finite number >= 0 (got {temperature})")
    for flag, value in (("--tp", tp), ("--dcp", dcp), ("--max-tokens", max_tokens)):
        if value < 1:
            raise QualError(f"{flag} must be >= 1 (got {value})")
    if seed < 0:
        raise QualError(f"--seed must be >= 0 (got {seed})")
    requests = read_prompts(prompts, str(target))
    rows = engine_class("reference").generate(
        str(target), str(draft) if draft else None, requests, tp=tp, dcp=dcp, max_tokens=max_tokens, dtype=dtype,
        temperature=temperature, seed=seed, device=device, dsa_topk=dsa_topk)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if out is None:
        print(text, end="")
        return
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as exc:
        raise QualError(f"--out {out}: cannot write ({exc.strerror or exc})") from None
