"""Turn `qual run` options into a validated plan; every user mistake surfaces here, before anything starts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path

from qual import paths
from qual.baseline import Configuration
from qual.corpus import load_corpus
from qual.engines.registry import engine_class, get_engine
from qual.errors import QualError
from qual.gate import gate_file, load_gate, needs_baseline
from qual.harness.baseline import ResolvedBaseline, check_match, resolve
from qual.profiles import load_profile
from qual.records import ArmConfig, EngineRequest, Sampling
from qual.tokenize import PromptTokenizer

PLAN_FILE = "run.json"
DRAFT_KV_MODES = ("replicated", "sharded")
DEFAULT_DCP = 4  # the candidate's DCP size when neither --dcp nor the profile says


@dataclass(frozen=True)
class RunOptions:
    """Exactly what the user asked for (saved in run.json so --resume repeats it); None = not asked."""

    model: str = "toy"
    dcp: int | None = None  # default: the profile's dcp, else DEFAULT_DCP
    tp: int | None = None  # default: the profile's tp, else the DCP size
    engine: str = "reference"
    corpus: str | None = None
    limit: int | None = None
    max_tokens: int | None = None
    draft_kv: str | None = None  # default: replicated (the reference engine) or what the vLLM build does
    temperature: float = 0.0
    seed: int = 0
    gate: str | None = None
    out: str | None = None
    history: str | None = None
    device: str | None = None  # default: cpu
    dtype: str | None = None
    baseline: str | None = None  # a result dir / result.json, a history id, or history:last-pass

    def command(self) -> str:
        """The `qual run` command line that reproduces this run."""
        parts = ["qual run", f"--model {self.model}", f"--engine {self.engine}"]
        for flag, value in [("--dcp", self.dcp), ("--tp", self.tp), ("--draft-kv", self.draft_kv), ("--corpus", self.corpus),
                            ("--limit", self.limit), ("--max-tokens", self.max_tokens), ("--gate", self.gate),
                            ("--device", self.device), ("--dtype", self.dtype), ("--baseline", self.baseline)]:
            if value is not None:
                parts.append(f"{flag} {value}")
        parts += [f"--temperature {self.temperature:g}", f"--seed {self.seed}"]
        return " ".join(parts)

    def requested(self) -> frozenset[str]:
        """The knobs the user set explicitly (an engine that cannot apply one of them refuses the run)."""
        asked = {"dcp": self.dcp, "tp": self.tp, "draft_kv": self.draft_kv, "device": self.device, "dtype": self.dtype}
        return frozenset(k for k, v in asked.items() if v is not None) | {"temperature", "seed"}


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
    baseline: ResolvedBaseline | None = None  # --baseline, resolved and checked against this plan

    @property
    def configuration(self) -> Configuration:
        """The configuration this run belongs to (history:last-pass and pins select on it)."""
        return Configuration.of(self.arms["candidate"].to_json(), self.corpus_info["fingerprint"], self.corpus_info["count"])

    def save(self) -> None:
        data = {"options": asdict(self.options), "corpus": self.corpus_info, "arms": {k: a.to_json() for k, a in self.arms.items()}}
        if self.baseline is not None:
            data["baseline"] = {"ref": self.baseline.ref, "chosen_by": self.baseline.chosen_by,
                                "history_id": self.baseline.history_id, "path": str(self.baseline.path)}
        (self.out_dir / PLAN_FILE).write_text(json.dumps(data, indent=2))


def _validate_options(o: RunOptions) -> None:
    engine_class(o.engine)  # an unknown engine name is a usage error
    if o.draft_kv is not None and o.draft_kv not in DRAFT_KV_MODES:
        raise QualError(f"--draft-kv must be one of {', '.join(DRAFT_KV_MODES)} (got {o.draft_kv!r})")
    for flag, value in (("--dcp", o.dcp), ("--tp", o.tp), ("--limit", o.limit), ("--max-tokens", o.max_tokens)):
        if value is not None and value < 1:
            raise QualError(f"{flag} must be >= 1 (got {value})")
    if o.temperature < 0:
        raise QualError(f"--temperature must be >= 0 (got {o.temperature})")


def _tokenize(profile, corpus, selected, o: RunOptions, dry_run: bool) -> list[EngineRequest]:
    """Prompts are tokenized once, here, so both arms receive identical token ids (a dry run tokenizes nothing)."""
    if dry_run:
        return []
    if not Path(profile.tokenizer_path).is_dir():
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


def make_plan(o: RunOptions, now: datetime | None = None, dry_run: bool = False) -> RunPlan:
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
    engine = get_engine(o.engine)
    if engine.local_checkpoints and not dry_run:
        _check_local(profile)
    corpus = load_corpus(o.corpus if o.corpus is not None else profile.corpus)
    selected = list(corpus.requests[: o.limit] if o.limit else corpus.requests)
    requests = _tokenize(profile, corpus, selected, o, dry_run)
    default_max = o.max_tokens or profile.max_tokens
    extra = {"max_model_len": profile.max_model_len, "tokenizer": profile.tokenizer_path,
             o.engine: profile.section(o.engine)}
    candidate = ArmConfig(
        engine=o.engine, model=profile.name, dcp=dcp, tp=tp, draft_kv=o.draft_kv or "replicated",
        target_path=profile.target_path, draft_path=profile.draft_path,
        num_speculative_tokens=profile.num_speculative_tokens,
        sampling=Sampling(temperature=o.temperature, seed=o.seed, max_tokens=default_max),
        interleave=profile.interleave, dtype=o.dtype or profile.dtype, device=o.device or "cpu", extra=extra,
    )
    arms = {"control": replace(candidate, dcp=1), "candidate": candidate}
    if not dry_run:  # checkpoints, head layout vs tp/dcp, installs: refused before anything is written
        arms = {name: engine.preflight(arm, o.requested()) for name, arm in arms.items()}
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(o.out) if o.out else paths.REPORTS_DIR / f"{stamp}-{profile.name}-dcp{dcp}"
    corpus_info = {"name": corpus.name, "path": str(corpus.path), "fingerprint": corpus.fingerprint, "count": len(selected),
                   "total_in_corpus": len(corpus.requests)}
    history = Path(o.history) if o.history else paths.DEFAULT_HISTORY
    plan = RunPlan(o, profile.name, corpus_info, requests, arms, gate_path, out_dir, history)
    if o.baseline is not None:  # found and checked now: a baseline that cannot serve is exit 2 before any arm runs
        plan.baseline = resolve(o.baseline, history, plan.configuration)
        check_match(plan.baseline, arms, corpus.fingerprint, [r.id for r in selected])
    return plan


def load_plan_options(run_dir: Path) -> RunOptions:
    """The options a previous run was started with (for --resume)."""
    path = run_dir / PLAN_FILE
    if not path.is_file():
        raise QualError(f"--resume {run_dir}: no {PLAN_FILE} there (not a qual run directory)")
    try:
        data = json.loads(path.read_text())
        saved = data["options"]
        known = {f.name for f in fields(RunOptions)}
        return RunOptions(**{k: v for k, v in saved.items() if k in known})
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise QualError(f"{path}: unreadable run plan ({exc})") from None
