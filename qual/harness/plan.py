"""Turn `qual run` options into a validated plan; every user mistake surfaces here, before anything starts."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path

from qual import paths
from qual.corpus import load_corpus
from qual.engines.registry import engine_class, get_engine
from qual.errors import QualError
from qual.gate import load_gate
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
    # Attach mode (an engine that `attaches`): the running servers of both arms, and how to use them.
    control_url: str | None = None
    candidate_url: str | None = None
    api_key_env: str | None = None  # NAME (both servers) or CONTROL_NAME,CANDIDATE_NAME; the keys are never saved
    exclusive: bool = False  # the user asserts the servers serve this run alone
    max_concurrency: int | None = None  # requests in flight per arm (default 1)

    def command(self) -> str:
        """The `qual run` command line that reproduces this run."""
        parts = ["qual run", f"--model {self.model}", f"--engine {self.engine}"]
        for flag, value in [("--dcp", self.dcp), ("--tp", self.tp), ("--draft-kv", self.draft_kv), ("--corpus", self.corpus),
                            ("--limit", self.limit), ("--max-tokens", self.max_tokens), ("--gate", self.gate),
                            ("--device", self.device), ("--dtype", self.dtype), ("--control-url", self.control_url),
                            ("--candidate-url", self.candidate_url), ("--api-key-env", self.api_key_env),
                            ("--max-concurrency", self.max_concurrency)]:
            if value is not None:
                parts.append(f"{flag} {value}")
        if self.exclusive:
            parts.append("--exclusive")
        parts += [f"--temperature {self.temperature:g}", f"--seed {self.seed}"]
        return " ".join(parts)

    def servers(self) -> dict[str, dict]:
        """Per arm, the running server an attaching engine uses (ArmConfig.extra["server"])."""
        names = self.api_key_env.split(",") if self.api_key_env else [None]
        keys = dict(zip(("control", "candidate"), names * 2 if len(names) == 1 else names))
        return {arm: {"url": url, "arm": arm, "api_key_env": keys[arm], "exclusive": self.exclusive,
                      "max_concurrency": self.max_concurrency or 1}
                for arm, url in (("control", self.control_url), ("candidate", self.candidate_url))}

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

    def save(self) -> None:
        data = {"options": asdict(self.options), "corpus": self.corpus_info, "arms": {k: a.to_json() for k, a in self.arms.items()}}
        (self.out_dir / PLAN_FILE).write_text(json.dumps(data, indent=2))


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _validate_attach(o: RunOptions, attaches: bool) -> None:
    """The attach-mode options: all of them need an engine that attaches, and it needs both URLs."""
    urls = {"--control-url": o.control_url, "--candidate-url": o.candidate_url}
    if not attaches:
        given = [flag for flag, v in [*urls.items(), ("--api-key-env", o.api_key_env), ("--exclusive", o.exclusive or None),
                                      ("--max-concurrency", o.max_concurrency)] if v is not None]
        if given:
            raise QualError(f"{given[0]} applies to attached servers (--control-url, --candidate-url); "
                            f"--engine {o.engine} starts its own")
        return
    missing = [flag for flag, url in urls.items() if not url]
    if missing:
        raise QualError(f"--engine {o.engine} attaches to running servers: give {' and '.join(missing)}")
    for flag, url in urls.items():
        if not re.match(r"^https?://[^\s/]+", url):
            raise QualError(f"{flag} must be an http:// or https:// URL (got {url!r})")
    names = o.api_key_env.split(",") if o.api_key_env is not None else []
    if o.api_key_env is not None and (len(names) > 2 or not all(_ENV_NAME.match(n) for n in names)):
        raise QualError(f"--api-key-env must be NAME or CONTROL_NAME,CANDIDATE_NAME of environment variables "
                        f"(got {o.api_key_env!r})")
    if o.max_concurrency is not None and o.max_concurrency < 1:
        raise QualError(f"--max-concurrency must be >= 1 (got {o.max_concurrency})")


def _validate_options(o: RunOptions) -> None:
    _validate_attach(o, engine_class(o.engine).attaches)  # an unknown engine name is a usage error
    if o.draft_kv is not None and o.draft_kv not in DRAFT_KV_MODES:
        raise QualError(f"--draft-kv must be one of {', '.join(DRAFT_KV_MODES)} (got {o.draft_kv!r})")
    for flag, value in (("--dcp", o.dcp), ("--tp", o.tp), ("--limit", o.limit), ("--max-tokens", o.max_tokens)):
        if value is not None and value < 1:
            raise QualError(f"{flag} must be >= 1 (got {value})")
    if o.temperature < 0:
        raise QualError(f"--temperature must be >= 0 (got {o.temperature})")


def _local_tokenizer(profile, engine) -> PromptTokenizer | None:
    """The profile's tokenizer where it is a local directory; an engine with its own tokenizer may do without."""
    if Path(profile.tokenizer_path).is_dir():
        return PromptTokenizer(profile.tokenizer_path)
    if engine.attaches:
        return None  # the control server's /tokenize decides (qual.engines.base.Engine.tokenize)
    key = "tokenizer" if profile.tokenizer else "target"
    raise QualError(f"{profile.path}: {key}: {profile.tokenizer_path!r} is not a local directory with a tokenizer "
                    "(prompts are tokenized once by qual; point the profile's tokenizer at a local copy)")


def _first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"token {i}: {a[i] if i < len(a) else 'end'} vs {b[i] if i < len(b) else 'end'} ({len(a)} vs {len(b)} tokens)"


def _tokenize(profile, corpus, selected, o: RunOptions, engine, arms: dict[str, ArmConfig],
              tokenizer: PromptTokenizer | None) -> list[EngineRequest]:
    """Prompts are tokenized once, here, so both arms receive identical token ids. Where an arm's engine tokenizes
    too (an attached server), it must agree on every prompt: matched replay needs identical token ids."""
    texts = [r.prompt for r in selected]
    theirs = {name: engine.tokenize(arm, texts) for name, arm in arms.items()}
    if tokenizer is not None:
        ids, by = [tokenizer.encode(t) for t in texts], f"the profile's tokenizer ({tokenizer.path})"
    else:
        ids, by = theirs["control"], "the control server"
    for name, got in theirs.items():
        if got is None or got is ids:
            continue
        for r, want, have in zip(selected, ids, got, strict=True):
            if want != have:
                raise QualError(f"mismatched tokenizers: the {name} server tokenizes request {r.id} differently from "
                                f"{by} ({_first_difference(want, have)}); matched replay needs identical prompt token ids")
    requests = []
    for r, prompt_ids in zip(selected, ids, strict=True):
        if not prompt_ids:
            raise QualError(f"corpus {corpus.name}: request {r.id} tokenizes to nothing")
        requests.append(EngineRequest(r.id, r.category, tuple(prompt_ids), o.max_tokens or r.max_tokens or profile.max_tokens))
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
    gate_path = str(Path(o.gate) if o.gate else paths.DEFAULT_GATE)
    load_gate(gate_path)  # a broken gate file is a usage error now, not after an hour of replay
    engine = get_engine(o.engine)
    if engine.local_checkpoints and not dry_run:
        _check_local(profile)
    corpus = load_corpus(o.corpus if o.corpus is not None else profile.corpus)
    selected = list(corpus.requests[: o.limit] if o.limit else corpus.requests)
    tokenizer = None if dry_run else _local_tokenizer(profile, engine)  # a dry run tokenizes nothing
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
    if engine.attaches:
        servers = o.servers()
        arms = {name: replace(arm, extra={**arm.extra, "server": servers[name]}) for name, arm in arms.items()}
    requests = []
    if not dry_run:  # checkpoints, head layout vs tp/dcp, installs, servers: refused before anything is written
        arms = {name: engine.preflight(arm, o.requested()) for name, arm in arms.items()}
        requests = _tokenize(profile, corpus, selected, o, engine, arms, tokenizer)
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(o.out) if o.out else paths.REPORTS_DIR / f"{stamp}-{profile.name}-dcp{dcp}"
    corpus_info = {"name": corpus.name, "path": str(corpus.path), "fingerprint": corpus.fingerprint, "count": len(selected),
                   "total_in_corpus": len(corpus.requests)}
    history = Path(o.history) if o.history else paths.DEFAULT_HISTORY
    return RunPlan(o, profile.name, corpus_info, requests, arms, gate_path, out_dir, history)


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
