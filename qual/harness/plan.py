"""Turn `qual run` options into a validated plan; every user mistake surfaces here, before anything starts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from qual.corpus import load_corpus
from qual.engines.base import ENGINES, ArmConfig, EngineRequest, Sampling
from qual.errors import QualError
from qual.gate import load_gate
from qual.profiles import REPO_ROOT, load_profile
from qual.runtime.config import DRAFT_KV_MODES, ParallelConfig
from qual.tokenize import PromptTokenizer

PLAN_FILE = "run.json"
DEFAULT_GATE = REPO_ROOT / "configs" / "gates" / "nightly.yaml"
DEFAULT_HISTORY = REPO_ROOT / "reports" / "history.sqlite"


@dataclass(frozen=True)
class RunOptions:
    """Exactly what the user asked for (saved in run.json so --resume repeats it)."""

    model: str = "toy"
    dcp: int = 4
    tp: int | None = None
    engine: str = "reference"
    corpus: str | None = None
    limit: int | None = None
    max_tokens: int | None = None
    draft_kv: str = "replicated"
    temperature: float = 0.0
    seed: int = 0
    gate: str | None = None
    out: str | None = None
    history: str | None = None
    device: str = "cpu"
    dtype: str | None = None

    def command(self) -> str:
        """The `qual run` command line that reproduces this run."""
        parts = ["qual run", f"--model {self.model}", f"--dcp {self.dcp}", f"--engine {self.engine}", f"--draft-kv {self.draft_kv}"]
        for flag, value in [("--tp", self.tp), ("--corpus", self.corpus), ("--limit", self.limit), ("--max-tokens", self.max_tokens),
                            ("--gate", self.gate), ("--device", None if self.device == "cpu" else self.device), ("--dtype", self.dtype)]:
            if value is not None:
                parts.append(f"{flag} {value}")
        parts += [f"--temperature {self.temperature:g}", f"--seed {self.seed}"]
        return " ".join(parts)


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

    def save(self) -> None:
        data = {"options": asdict(self.options), "corpus": self.corpus_info, "arms": {k: a.to_json() for k, a in self.arms.items()}}
        (self.out_dir / PLAN_FILE).write_text(json.dumps(data, indent=2))


def _validate_options(o: RunOptions) -> None:
    if o.engine not in ENGINES:
        raise QualError(f"--engine must be one of {', '.join(ENGINES)} (got {o.engine!r})")
    if o.draft_kv not in DRAFT_KV_MODES:
        raise QualError(f"--draft-kv must be one of {', '.join(DRAFT_KV_MODES)} (got {o.draft_kv!r})")
    if o.dcp < 1:
        raise QualError(f"--dcp must be >= 1 (got {o.dcp})")
    if o.tp is not None and o.tp < 1:
        raise QualError(f"--tp must be >= 1 (got {o.tp})")
    if o.limit is not None and o.limit < 1:
        raise QualError(f"--limit must be >= 1 (got {o.limit})")
    if o.max_tokens is not None and o.max_tokens < 1:
        raise QualError(f"--max-tokens must be >= 1 (got {o.max_tokens})")
    if o.temperature < 0:
        raise QualError(f"--temperature must be >= 0 (got {o.temperature})")


def make_plan(o: RunOptions, now: datetime | None = None, dry_run: bool = False) -> RunPlan:
    """Resolve profile, corpus, tokenization and both arms; raise QualError on any bad input.

    A dry run needs no local tokenizer (real deployments name hub ids); it tokenizes nothing.
    """
    _validate_options(o)
    profile = load_profile(o.model)
    tp = o.tp if o.tp is not None else profile.tp or o.dcp
    for dcp in (1, o.dcp):
        ParallelConfig(tp, dcp, profile.interleave)  # tp % dcp, interleave >= 1
    gate_path = str(Path(o.gate) if o.gate else DEFAULT_GATE)
    load_gate(gate_path)  # a broken gate file is a usage error now, not after an hour of replay
    corpus = load_corpus(o.corpus or profile.corpus)
    selected = list(corpus.requests[: o.limit] if o.limit else corpus.requests)
    local_tokenizer = Path(profile.tokenizer_path).is_dir()
    if not local_tokenizer and not dry_run:
        raise QualError(f"model {profile.name}: tokenizer {profile.tokenizer_path!r} is not a local directory "
                        "(prompts are tokenized once by qual; point the profile's tokenizer at a local copy)")
    tokenizer = PromptTokenizer(profile.tokenizer_path) if local_tokenizer else None
    default_max = o.max_tokens or profile.max_tokens
    requests = []
    for r in selected if tokenizer else []:
        ids = tokenizer.encode(r.prompt)
        if not ids:
            raise QualError(f"corpus {corpus.name}: request {r.id} tokenizes to nothing")
        requests.append(EngineRequest(r.id, r.category, tuple(ids), o.max_tokens or r.max_tokens or default_max))
    sampling = Sampling(temperature=o.temperature, seed=o.seed, max_tokens=default_max)
    extra = {"block_size": profile.block_size, "kv_memory_mib": profile.kv_memory_mib, "max_model_len": profile.max_model_len,
             "reference": profile.reference, "vllm": profile.vllm, "tokenizer": profile.tokenizer_path}
    candidate = ArmConfig(
        engine=o.engine, model=profile.name, dcp=o.dcp, tp=tp, draft_kv=o.draft_kv, target_path=profile.target_path,
        draft_path=profile.draft_path, num_speculative_tokens=profile.num_speculative_tokens, sampling=sampling,
        interleave=profile.interleave, dtype=o.dtype or profile.dtype, device=o.device, extra=extra,
    )
    arms = {"control": replace(candidate, dcp=1), "candidate": candidate}
    if o.engine == "reference" and not dry_run:
        from qual.engines.reference import engine_config
        from qual.runtime.engine import validate

        for arm in arms.values():
            validate(engine_config(arm))  # head layout vs tp/dcp, checkpoints readable
    if o.engine == "vllm" and not dry_run:  # the control arm needs one whatever the machine: say so before writing
        from qual.engines.vllm.argv import VllmOptions
        from qual.engines.vllm.install import NOT_FOUND, locate

        python = VllmOptions.from_extra(extra).python
        if python is not None and not Path(python).is_file():
            raise QualError(f"vllm.python {python}: no such interpreter (the profile's vllm.python)")
        if locate(python) is None:
            raise QualError(NOT_FOUND)
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(o.out) if o.out else REPO_ROOT / "reports" / f"{stamp}-{profile.name}-dcp{o.dcp}"
    corpus_info = {"name": corpus.name, "path": str(corpus.path), "fingerprint": corpus.fingerprint, "count": len(selected),
                   "total_in_corpus": len(corpus.requests)}
    history = Path(o.history) if o.history else DEFAULT_HISTORY
    return RunPlan(o, profile.name, corpus_info, requests, arms, gate_path, out_dir, history)


def load_plan_options(run_dir: Path) -> RunOptions:
    """The options a previous run was started with (for --resume)."""
    path = run_dir / PLAN_FILE
    if not path.is_file():
        raise QualError(f"--resume {run_dir}: no {PLAN_FILE} there (not a qual run directory)")
    try:
        data = json.loads(path.read_text())
        return RunOptions(**data["options"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise QualError(f"{path}: unreadable run plan ({exc})") from None
