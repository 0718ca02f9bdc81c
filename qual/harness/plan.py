"""Turn `qual run` options into a validated plan; every user mistake surfaces here, before anything starts."""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as checked_dataclass

from qual import paths
from qual.baseline import Configuration
from qual.checkpoints.weights import inspect_weights
from qual.corpus import load_corpus
from qual.corpus.records import MAX_TOKENS
from qual.engines.registry import engine_class, get_engine
from qual.errors import QualError
from qual.files import write_text
from qual.gate import gate_file, load_gate, needs_baseline
from qual.harness.baseline import ResolvedBaseline, check_match, resolve
from qual.history import check_history
from qual.profiles import DTYPES, load_profile
from qual.records import ArmConfig, EngineRequest, Sampling
from qual.tokenize import PromptTokenizer
from qual.validation import describe_error, read_config_text

PLAN_FILE = "run.json"
DRAFT_KV_MODES = ("replicated", "sharded")
DSA_TOPK_MODES = ("exact", "union")
DEFAULT_DCP = 4  # the candidate's DCP size when neither --dcp nor the profile says
MAX_SEED = 2**63 - 1  # seeds travel as int64 (numpy, torch, vLLM's sampling params)


def _text():
    """An optional name or path: "" is a mistake, never "use the default"."""
    return Field(None, min_length=1)



@checked_dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid", allow_inf_nan=False))
class RunOptions:
    """Exactly what the user asked for (saved in run.json so --resume repeats it); None = not asked.

    Validated on construction, from the command line and from run.json alike: no coercion ("abc" is not a
    DCP size), no NaN or infinity, no negative seed, no empty name standing for the default.
    """

    model: str = Field("toy", min_length=1)
    dcp: int | None = Field(None, ge=1)  # default: the profile's dcp, else DEFAULT_DCP
    tp: int | None = Field(None, ge=1)  # default: the profile's tp, else the DCP size
    engine: str = Field("reference", min_length=1)
    corpus: str | None = _text()
    limit: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    draft_kv: Literal[DRAFT_KV_MODES] | None = None  # default: replicated (reference) or what the vLLM build does
    temperature: float = Field(0.0, ge=0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    gate: str | None = _text()
    out: str | None = _text()
    history: str | None = _text()
    device: str | None = Field(None, pattern=r"^(cpu|cuda(:[0-9]+)?)$")  # default: cpu
    dtype: Literal[DTYPES] | None = None
    dsa_topk: Literal[DSA_TOPK_MODES] | None = None  # sparse-attention targets: exact (default) | union
    baseline: str | None = _text()  # a result dir / result.json, a history id, or history:last-pass

    def command(self) -> str:
        """The `qual run` command line that reproduces this run."""
        parts = ["qual run", f"--model {self.model}", f"--engine {self.engine}"]
        for flag, value in [("--dcp", self.dcp), ("--tp", self.tp), ("--draft-kv", self.draft_kv), ("--corpus", self.corpus),
                            ("--limit", self.limit), ("--max-tokens", self.max_tokens), ("--gate", self.gate),
                            ("--device", self.device), ("--dtype", self.dtype), ("--dsa-topk", self.dsa_topk),
                            ("--baseline", self.baseline)]:
            if value is not None:
                parts.append(f"{flag} {value}")
        parts += [f"--temperature {self.temperature:g}", f"--seed {self.seed}"]
        return " ".join(parts)

    def requested(self) -> frozenset[str]:
        """The knobs the user set explicitly (an engine that cannot apply one of them refuses the run)."""
        asked = {"dcp": self.dcp, "tp": self.tp, "draft_kv": self.draft_kv, "device": self.device, "dtype": self.dtype,
                 "dsa_topk": self.dsa_topk}
        return frozenset(k for k, v in asked.items() if v is not None) | {"temperature", "seed"}


def run_options(**values) -> RunOptions:
    """RunOptions from the command line; a bad value is a QualError naming its flag."""
    try:
        return RunOptions(**values)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-")
        raise QualError(f"{flag}: {describe_error(exc).partition(': ')[2]}") from None


@dataclass
class RunPlan:
    options: RunOptions
    profile_name: str
    corpus_info: dict  # name, path, fingerprint, count (of the selected requests)
    requests: list[EngineRequest]
    arms: dict[str, ArmConfig]  # control, candidate
    gate_path: str
    out_dir: Path
    history_path: Path
    run_id: str = ""  # kept in run.json: a resumed run is the same run (recorded in the history once)
    baseline: ResolvedBaseline | None = None  # --baseline, resolved and checked against this plan

    @property
    def configuration(self) -> Configuration:
        """The configuration this run belongs to (history:last-pass and pins select on it)."""
        return Configuration.of(self.arms["candidate"].to_json(), self.corpus_info["fingerprint"], self.corpus_info["count"])

    def save(self) -> None:
        data = {"run_id": self.run_id, "options": asdict(self.options), "corpus": self.corpus_info,
                "arms": {k: a.to_json() for k, a in self.arms.items()}}
        if self.baseline is not None:
            data["baseline"] = {"ref": self.baseline.ref, "chosen_by": self.baseline.chosen_by,
                                "history_id": self.baseline.history_id, "path": str(self.baseline.path)}
        write_text(self.out_dir / PLAN_FILE, json.dumps(data, indent=2))


def _validate_options(o: RunOptions) -> None:
    engine_class(o.engine)  # an unknown engine name is a usage error (types and ranges: RunOptions itself)


def _tokenize(profile, corpus, selected, o: RunOptions, dry_run: bool) -> list[EngineRequest]:
    """Prompts are tokenized once, here, so both arms receive identical token ids.

    A dry run tokenizes only where the tokenizer is local (real deployments may name hub ids)."""
    if not Path(profile.tokenizer_path).is_dir():
        if dry_run:
            return []
        key = "tokenizer" if profile.tokenizer else "target"
        raise QualError(f"{profile.path}: {key}: {profile.tokenizer_path!r} is not a local directory with a tokenizer "
                        "(prompts are tokenized once by qual; point the profile's tokenizer at a local copy)")
    tokenizer = PromptTokenizer(profile.tokenizer_path)
    requests = []
    for r in selected:
        ids = tokenizer.encode(r.prompt)
        if not ids:
            raise QualError(f"corpus {corpus.name}: request {r.id} tokenizes to nothing")
        requests.append(EngineRequest(r.id, r.category, tuple(ids), o.max_tokens or r.max_tokens or profile.max_tokens))
    return requests


def _check_local(profile) -> None:
    """The profile's checkpoints are local directories (an engine that loads them itself needs them here)."""
    for key in ("target", "draft"):
        value = getattr(profile, key)
        if value is not None and not Path(profile.local_path(value)).is_dir():
            raise QualError(f"{profile.path}: {key}: {value!r} is not a checkpoint directory (looked beside the "
                            f"profile and in qual's data folder)")


def _check_weights(profile, dtype: str) -> None:
    """Every local checkpoint's safetensors files are whole, and hold weights the run's dtype may take.

    Headers only (no tensor is read): a truncated file or a silently lossy cast is refused before any work."""
    for key in ("target", "draft"):
        value = getattr(profile, key)
        if value is not None and Path(profile.local_path(value)).is_dir():
            inspect_weights(profile.local_path(value), dtype, profile.weights_dtype,
                            f"{profile.path}: {key}")


def _check_lengths(engine, arms: dict[str, ArmConfig], corpus, selected, requests: list[EngineRequest],
                   default_max: int) -> None:
    """Every request fits every arm's context: prompt + max_tokens (+ the engine's speculative headroom).

    Without token ids (a dry run with a hub tokenizer) a prompt counts as one token: max_tokens alone can
    already be impossible."""
    lengths = {r.id: (len(r.prompt_token_ids), r.max_tokens) for r in requests}
    for r in selected:
        prompt, max_tokens = lengths.get(r.id, (1, r.max_tokens or default_max))
        for name, arm in arms.items():
            needed, limit = engine.context_needed(arm, prompt, max_tokens), engine.max_model_len(arm)
            if needed > limit:
                what = f"prompt {prompt} tokens" if r.id in lengths else "a prompt of at least 1 token"
                raise QualError(f"corpus {corpus.name}: request {r.id}: {what} + max_tokens {max_tokens} needs "
                                f"{needed} positions, more than the {name} arm's max_model_len {limit}")


def make_plan(o: RunOptions, now: datetime | None = None, dry_run: bool = False, run_id: str | None = None) -> RunPlan:
    """Resolve profile, corpus, tokenization and both arms; raise QualError on any bad input.

    A dry run needs no local tokenizer or engine install (real deployments name hub ids); it checks the rest.
    """
    _validate_options(o)
    profile = load_profile(o.model)
    dcp = o.dcp or profile.dcp or DEFAULT_DCP
    tp = o.tp or profile.tp or dcp
    if tp % dcp:  # every engine's DCP groups split the TP group (docs/dcp.md)
        raise QualError(f"constraint tp % dcp == 0 violated: tp={tp} is not divisible by dcp={dcp}")
    gate_path = str(gate_file(o.gate) if o.gate else paths.DEFAULT_GATE)
    gate = load_gate(gate_path)  # a broken gate file is a usage error now, not after an hour of replay
    if o.baseline is None and needs_baseline(gate):
        r = needs_baseline(gate)[0]
        raise QualError(f"{gate_path}: rule {r.index} ({r.check}) compares with a baseline: give --baseline REF "
                        "(a run directory, a history id or history:last-pass), or mark the rule without_baseline: skip")
    history = Path(o.history) if o.history else paths.DEFAULT_HISTORY
    check_history(history, "--history")  # not a database, or read-only: refused now, not after both arms
    engine = get_engine(o.engine)
    if engine.local_checkpoints and not dry_run:
        _check_local(profile)
    dtype = o.dtype or profile.dtype
    _check_weights(profile, dtype)
    corpus = load_corpus(o.corpus if o.corpus is not None else profile.corpus)
    selected = list(corpus.requests[: o.limit] if o.limit else corpus.requests)
    requests = _tokenize(profile, corpus, selected, o, dry_run)
    default_max = o.max_tokens or profile.max_tokens
    extra = {"max_model_len": profile.max_model_len, "tokenizer": profile.tokenizer_path,
             o.engine: profile.section(o.engine)}
    if profile.weights_dtype is not None:  # the cast the profile asked for is part of what ran
        extra["weights_dtype"] = profile.weights_dtype
    candidate = ArmConfig(
        engine=o.engine, model=profile.name, dcp=dcp, tp=tp, draft_kv=o.draft_kv or "replicated",
        target_path=profile.target_path, draft_path=profile.draft_path,
        num_speculative_tokens=profile.num_speculative_tokens,
        sampling=Sampling(temperature=o.temperature, seed=o.seed, max_tokens=default_max),
        interleave=profile.interleave, dtype=dtype, device=o.device or "cpu", extra=extra, dsa_topk=o.dsa_topk,
    )
    arms = {"control": replace(candidate, dcp=1), "candidate": candidate}
    if not dry_run:  # checkpoints, head layout vs tp/dcp, installs: refused before anything is written
        arms = {name: engine.preflight(arm, o.requested()) for name, arm in arms.items()}
    _check_lengths(engine, arms, corpus, selected, requests, default_max)
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(o.out) if o.out else paths.REPORTS_DIR / f"{stamp}-{profile.name}-dcp{dcp}"
    corpus_info = {"name": corpus.name, "path": str(corpus.path), "fingerprint": corpus.fingerprint, "count": len(selected),
                   "total_in_corpus": len(corpus.requests)}
    plan = RunPlan(o, profile.name, corpus_info, requests, arms, gate_path, out_dir, history, run_id or uuid.uuid4().hex)
    if o.baseline is not None:  # found and checked now: a baseline that cannot serve is exit 2 before any arm runs
        plan.baseline = resolve(o.baseline, history, plan.configuration)
        check_match(plan.baseline, arms, corpus.fingerprint, [r.id for r in selected])
    return plan


@dataclass(frozen=True)
class SavedPlan:
    """What run.json says about a started run (for --resume)."""

    options: RunOptions
    fingerprint: str  # the corpus's, when the run started
    run_id: str | None  # None: written by a qual that kept no run id


def load_plan(run_dir: Path) -> SavedPlan:
    """run.json of a previous run, validated key by key (a hand-edited or truncated file is exit 2)."""
    path = run_dir / PLAN_FILE
    if not path.is_file():
        raise QualError(f"--resume {run_dir}: no {PLAN_FILE} there (not a qual run directory)")
    try:
        data = json.loads(read_config_text(path))
    except json.JSONDecodeError as exc:
        raise QualError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    except OSError as exc:
        raise QualError(f"{path}: unreadable ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise QualError(f"{path}: expected a JSON object")
    for key in ("options", "corpus"):
        if not isinstance(data.get(key), dict):
            raise QualError(f"{path}: {key}: {'missing' if key not in data else 'must be an object'}")
    fingerprint = data["corpus"].get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint.startswith("sha256:"):
        raise QualError(f"{path}: corpus.fingerprint: {'missing' if fingerprint is None else 'not a sha256: fingerprint'}")
    run_id = data.get("run_id")
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise QualError(f"{path}: run_id: must be a non-empty string")
    try:
        options = RunOptions(**data["options"])
    except ValidationError as exc:
        raise QualError(f"{path}: {describe_error(exc, 'options')}") from None
    return SavedPlan(options, fingerprint, run_id)
