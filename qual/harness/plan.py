"""Turn `qual run` options into a validated plan; every user mistake surfaces here, before anything starts."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as checked_dataclass

from qual import paths, shown
from qual.chat import load_template
from qual.configuration import ConfigurationKey
from qual.checkpoints.weights import inspect_weights
from qual.corpus import load_corpus
from qual.corpus.manifest import manifest_problems
from qual.corpus.records import MAX_TOKENS
from qual.engines.registry import engine_class, get_engine
from qual.errors import QualError
from qual.files import is_leftover, write_text
from qual.gate import Gate, gate_file, load_gate, needs_baseline
from qual.harness import sweep
from qual.harness.baseline import LAST_PASS, ResolvedBaseline, check_match, resolve
from qual.harness.speedup import PLAIN_ARM, plain_arm
from qual.harness.inputs import check_sealed, checkpoint_records, identities, run_inputs, seal
from qual.harness.turns import ChatPrompts, Conversation, request_ids
from qual.history import check_history
from qual.inventory import hub_download_command
from qual.nights import axis_choices, check_axis, is_axis, parse_meta
from qual.options import (DEFAULT_DCP, DEFAULT_DEVICE, DEFAULT_DRAFT_KV, DEFAULT_ENGINE, DEFAULT_TEMPERATURE,
                          MAX_SEED, REVISION_KEYS, SWEEP_SEPARATOR, Device, DraftKv, DsaTopk, Dtype, Numerics,
                          check_layout)
from qual.profiles import fit_positions, load_profile
from qual.records import ArmConfig, EngineRequest, Sampling
from qual.tokenize import PromptTokenizer
from qual.userfiles import check_path_name, load_json
from qual.validation import describe_error, parse_flags, read_config_text

PLAN_FILE = "run.json"
RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")  # what run.json's run_id may be (qual writes uuid4 hex)


def _text():
    """An optional name or path: "" is a mistake, never "use the default"."""
    return Field(None, min_length=1)


def _axis(value: str) -> str:
    if not is_axis(value):
        raise ValueError(f"expected one of {axis_choices()}")
    return value


# --axis as run.json holds it: checked on --resume as on the command line
Axis = Annotated[str, AfterValidator(_axis)]


@checked_dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid", allow_inf_nan=False))
class RunOptions:
    """Exactly what the user asked for (saved in run.json so --resume repeats it); None = not asked.

    Validated on construction, from the command line and from run.json alike: no coercion ("abc" is not a
    DCP size), no NaN or infinity, no negative seed, no empty name standing for the default.
    """

    model: str = Field("toy", min_length=1)
    # Checkpoint directories that replace the profile's target / draft (a real model's profile names hub ids)
    target: str | None = _text()
    draft: str | None = _text()
    # dcp, draft_kv, dsa_topk: one value, or a list of two or more (a sweep: qual/harness/sweep.py)
    dcp: sweep.one_or_many(Annotated[int, Field(ge=1)]) | None = None  # default: the profile's dcp, else DEFAULT_DCP
    tp: int | None = Field(None, ge=1)  # default: the profile's tp, else the DCP size
    engine: str | None = _text()  # default: attach where URLs are given, else the profile's, else DEFAULT_ENGINE
    corpus: str | None = _text()
    chat_template: str | None = _text()  # a Jinja file in place of the tokenizer's chat template (chat rows)
    limit: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    draft_kv: sweep.one_or_many(DraftKv) | None = None  # default: DEFAULT_DRAFT_KV (reference) or what the vLLM build does
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    gate: str | None = _text()
    out: str | None = _text()
    history: str | None = _text()
    device: Device | None = None  # default: the profile's, else DEFAULT_DEVICE
    dtype: Dtype | None = None
    dsa_topk: sweep.one_or_many(DsaTopk) | None = None  # sparse-attention targets (default: the engine's, DEFAULT_DSA_TOPK)
    numerics: Numerics | None = None  # targets with a choice (default: the profile's, else DEFAULT_NUMERICS)
    baseline: str | None = _text()  # a result dir / result.json, a history id, or history:last-pass
    baseline_any: bool = False  # take a baseline of another configuration key (the differences are recorded)
    baseline_required: bool = False  # history:last-pass with nothing to compare with is exit 2, not a first night
    meta: dict[str, str] | None = None  # --meta KEY=VALUE: the night's labels (qual.nights.parse_meta)
    axis: Axis = "date"  # what the report's strip of this series' nights runs along (qual.nights.axis_value)
    # Attach mode (an engine that `attaches`): the running servers of both arms, and how to use them.
    control_url: str | None = _text()
    candidate_url: str | None = _text()
    api_key_env: str | None = _text()  # NAME (both servers) or CONTROL_NAME,CANDIDATE_NAME; the keys are never saved
    exclusive: bool = False  # the user asserts the servers serve this run alone
    max_concurrency: int | None = Field(None, ge=1)  # requests in flight per arm (default 1)
    speedup: bool = False  # also the candidate's configuration without the drafter: what speculation buys

    def command(self, engine: str | None = None) -> str:
        """The `qual run` command line that reproduces this run (engine: as the plan resolved it), shell-quoted (a
        path with a space or `;` in it is one argument when pasted into a shell)."""
        parts = ["qual", "run", "--model", self.model, "--engine", engine or self.engine]
        for flag, value in [("--target", self.target), ("--draft", self.draft), ("--dcp", self.dcp), ("--tp", self.tp), ("--draft-kv", self.draft_kv), ("--corpus", self.corpus),
                            ("--chat-template", self.chat_template),
                            ("--limit", self.limit), ("--max-tokens", self.max_tokens), ("--gate", self.gate),
                            ("--device", self.device), ("--dtype", self.dtype), ("--dsa-topk", self.dsa_topk),
                            ("--numerics", self.numerics), ("--baseline", self.baseline), ("--control-url", self.control_url),
                            ("--candidate-url", self.candidate_url), ("--api-key-env", self.api_key_env),
                            ("--max-concurrency", self.max_concurrency)]:
            if isinstance(value, tuple):  # a sweep's list
                value = SWEEP_SEPARATOR.join(map(str, value))
            if value is not None:
                parts += [flag, str(value)]
        if self.exclusive:
            parts.append("--exclusive")
        if self.baseline_any:
            parts.append("--baseline-any")
        if self.baseline_required:
            parts.append("--baseline-required")
        for key, value in (self.meta or {}).items():
            parts += ["--meta", f"{key}={value}"]  # quoted once, by shown.command
        if self.axis != "date":
            parts += ["--axis", self.axis]
        if self.speedup:
            parts.append("--speedup")
        parts += ["--temperature", f"{self.temperature:g}", "--seed", str(self.seed)]
        return shown.command(parts)

    def servers(self) -> dict[str, dict]:
        """Per arm, the running server an attaching engine uses (ArmConfig.extra["server"])."""
        names = self.api_key_env.split(",") if self.api_key_env else [None]
        keys = dict(zip(("control", "candidate"), names * 2 if len(names) == 1 else names))
        return {arm: {"url": url, "arm": arm, "api_key_env": keys[arm], "exclusive": self.exclusive,
                      "max_concurrency": self.max_concurrency or 1}
                for arm, url in (("control", self.control_url), ("candidate", self.candidate_url))}

    def requested(self) -> frozenset[str]:
        """The knobs the user set explicitly (an engine that cannot apply one of them refuses the run)."""
        asked = {"dcp": self.dcp, "tp": self.tp, "draft_kv": self.draft_kv, "device": self.device, "dtype": self.dtype,
                 "dsa_topk": self.dsa_topk, "numerics": self.numerics}
        return frozenset(k for k, v in asked.items() if v is not None) | {"temperature", "seed"}


def run_options(**values) -> RunOptions:
    """RunOptions from the command line ("2,4" in a swept flag is a list, --meta's pairs a mapping); a bad value is a
    QualError naming its flag."""
    values["meta"] = parse_meta(values.get("meta") or ()) or None
    if "axis" in values:  # refused in `qual history trend --axis`'s words, before any work
        check_axis(values["axis"])
    return parse_flags(RunOptions, **sweep.split_flags(values))


@dataclass
class RunPlan:
    options: RunOptions
    profile_name: str
    corpus_info: dict  # name, path, fingerprint, count (of the selected requests)
    requests: list[EngineRequest]
    # control, candidate (or a sweep's candidates: qual.harness.sweep), and with --speedup plain (the candidate
    # without its drafter)
    arms: dict[str, ArmConfig]
    gate_path: str
    out_dir: Path
    history_path: Path
    run_id: str = ""  # kept in run.json: a resumed run is the same run (recorded in the history once)
    notes: list[str] = field(default_factory=list)  # what the user should hear before the run (stderr: "warning:")
    baseline: ResolvedBaseline | None = None  # --baseline, resolved and checked against this plan
    first_night: bool = False  # --baseline history:last-pass found nothing: the series' first night
    inputs: dict | None = None  # what the run depends on (qual.harness.inputs), recorded in run.json
    engine_version: str | None = None  # the candidate engine's, as its run will record it (None: not known yet)
    # Conversations of several turns: `requests` holds their first turns, each arm builds the later ones from its own
    # answers (qual.harness.turns); request_ids: every request of the run, later turns included, in corpus order.
    conversations: list[Conversation] = field(default_factory=list)
    prompts: ChatPrompts | None = None
    request_ids: list[str] = field(default_factory=list)
    profile_path: str = ""  # the profile file the run reads (its origin: qual.paths.origin)
    how: str = ""  # the engine and device, and whence (qual.harness.plan.how_it_runs)
    lacking: list[str] = field(default_factory=list)  # a dry run: what this machine lacks for the run (a run: exit 2)
    inventory: Any = None  # what the machine was asked (qual.inventory.Inventory; None: this machine's)
    # The clock chat templates read (strftime_now): fixed when the run starts and kept in run.json, so that every arm
    # and every resume renders the same prompts
    render_time: datetime | None = None
    journals_sealed: bool = True  # every journal line carries its digest (False: a run begun by a qual before that)
    # The gate's rules as read when the plan was made: the verdict's, and the digest run.json and provenance record,
    # whatever the file holds by the time the arms are done
    gate: Gate | None = None

    @property
    def candidates(self) -> list[str]:
        """The candidate arms' names: ["candidate"], or a sweep's, in the order they run."""
        return [name for name in self.arms if name not in (sweep.CONTROL, PLAIN_ARM)]

    @property
    def engine(self) -> str:
        """The engine every arm runs on (a flag, else the profile's, else qual's default)."""
        return self.arms[sweep.CONTROL].engine

    @property
    def is_sweep(self) -> bool:
        return bool(sweep.swept(self.options))

    @property
    def configuration(self) -> ConfigurationKey:
        """The configuration key this run belongs to (history:last-pass, pins, the report's strip select on it); a
        sweep's first candidate's."""
        return self.configuration_of(self.candidates[0])

    def configuration_of(self, name: str) -> ConfigurationKey:
        """The configuration key of one candidate (a sweep's each have their own)."""
        candidate = self.arms[name].to_json()
        return ConfigurationKey.of(candidate, self.corpus_info["fingerprint"], self.corpus_info["count"],
                                   identities(checkpoint_records(candidate)))

    def save(self) -> None:
        # The history as a full path: a --resume from another directory records the run in the database it began
        # with, not in a new one beside that directory
        options = {**asdict(self.options), "history": str(Path(self.history_path).absolute())}
        data = {"run_id": self.run_id, "options": options, "corpus": self.corpus_info,
                "arms": {k: a.to_json() for k, a in self.arms.items()}, "inputs": self.inputs}
        if self.render_time is not None:
            data["render_time"] = self.render_time.isoformat()
        if self.journals_sealed:
            data["journals_sealed"] = True
        if self.baseline is not None:
            data["baseline"] = {"ref": self.baseline.ref, "chosen_by": self.baseline.chosen_by,
                                "history_id": self.baseline.history_id, "path": str(self.baseline.path)}
        write_text(self.out_dir / PLAN_FILE, json.dumps(seal(data), indent=2))


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _validate_attach(o: RunOptions, engine: str, attaches: bool) -> None:
    """The attach-mode options: all of them need an engine that attaches, and it needs both URLs."""
    urls = {"--control-url": o.control_url, "--candidate-url": o.candidate_url}
    if not attaches:
        given = [flag for flag, v in [*urls.items(), ("--api-key-env", o.api_key_env), ("--exclusive", o.exclusive or None),
                                      ("--max-concurrency", o.max_concurrency)] if v is not None]
        if given:
            raise QualError(f"{given[0]} applies to attached servers (--control-url, --candidate-url); "
                            f"--engine {engine} starts its own")
        return
    missing = [flag for flag, url in urls.items() if not url]
    if missing:
        raise QualError(f"--engine {engine} attaches to running servers: give {' and '.join(missing)}")
    from qual.redact import check_api_key, check_server_url

    for flag, url in urls.items():  # http(s), a host, no credentials, no control characters (a message never shows them)
        check_server_url(flag, url)
    names = o.api_key_env.split(",") if o.api_key_env is not None else []
    if o.api_key_env is not None and (len(names) > 2 or not all(_ENV_NAME.match(n) for n in names)):
        raise QualError(f"--api-key-env must be NAME or CONTROL_NAME,CANDIDATE_NAME of environment variables "
                        f"(got {o.api_key_env!r})")
    for name in names:  # a key an HTTP header cannot carry is refused now, never echoed (an unset one: at attach)
        check_api_key(name)


def _engine_name(o: RunOptions, profile) -> str:
    """--engine, else attach where servers are named (--control-url, --candidate-url), else the profile's engine,
    else qual's default."""
    if o.engine is not None:
        return o.engine
    if o.control_url or o.candidate_url:
        return "attach"
    return profile.engine or DEFAULT_ENGINE


def _validate_options(o: RunOptions, engine: str) -> None:
    # an unknown engine name is a usage error (types and ranges: RunOptions itself)
    attaches = engine_class(engine).attaches
    _validate_attach(o, engine, attaches)
    sweep.check_supported(o, engine, attaches)
    if o.speedup and attaches:
        raise QualError(f"--speedup runs the candidate's configuration without its drafter: --engine {engine} "
                        "attaches to servers that run with theirs; use an engine that starts its own")
    if o.speedup and sweep.swept(o):
        raise QualError(f"--speedup with a sweep ({sweep.describe(o)}): measure the speedup of one candidate at a time")


def _tokenizer_dir(profile, engine) -> str | None:
    """The profile's tokenizer as a local directory: its path, or a hub id's folder in the local Hugging Face cache
    (asked of the engine's inventory); None where it is neither."""
    if Path(profile.tokenizer_path).is_dir():
        return profile.tokenizer_path
    revision = profile.target_revision if profile.tokenizer_path == profile.target_path else None
    found = engine.inventory.hub_snapshot(profile.tokenizer_path, revision)
    return str(found) if found is not None else None


def _local_tokenizer(profile, engine, dry_run: bool) -> PromptTokenizer | None:
    """The profile's tokenizer where it is a local directory (or in the Hugging Face cache). An engine with its own
    tokenizer may do without, and so may a dry run (real deployments may name hub ids)."""
    local = _tokenizer_dir(profile, engine)
    if local is not None:
        return PromptTokenizer(local)
    if engine.attaches or dry_run:
        return None  # the control server's /tokenize decides (qual.engines.base.Engine.tokenize)
    key = "tokenizer" if profile.tokenizer else "target"
    raise QualError(f"{profile.path}: {key}: {profile.tokenizer_path!r} is not a local directory with a tokenizer "
                    "(prompts are tokenized once by qual; point the profile's tokenizer at a local copy)")


def how_it_runs(o: RunOptions, profile, engine: str, device: str) -> str:
    """'--engine vllm --device cuda, the profile's': the engine and device a run resolved, and whence."""
    def whence(given, from_profile) -> str:
        return "given" if given else "the profile's" if from_profile else "qual's default"

    said = [(f"--engine {engine}", whence(o.engine or o.control_url or o.candidate_url, profile.engine)),
            (f"--device {device}", whence(o.device, profile.device))]
    if said[0][1] == said[1][1]:
        return f"{said[0][0]} {said[1][0]}, {said[0][1]}"
    return ", ".join(f"{flag} ({source})" for flag, source in said)


def machine_problems(profile, engine, arms: dict[str, ArmConfig]) -> list[str]:
    """What this machine lacks for the arms (engine.missing, asked of its inventory) and for qual's own tokenization
    (the profile's tokenizer, local or in the Hugging Face cache), each once, in the order found."""
    found = engine.missing(list(arms.values()), profile.gpu_memory_gib)
    if not engine.attaches and _tokenizer_dir(profile, engine) is None and profile.tokenizer_path not in (
            profile.target_path, profile.draft_path):  # the checkpoint's own line says so
        found.append(f"tokenizer {profile.tokenizer_path} is neither a local directory nor in the local Hugging Face "
                     f"cache (qual tokenizes every prompt): {hub_download_command(profile.tokenizer_path, None)}")
    return list(dict.fromkeys(found))


def _noting_tp(check, note: str | None):
    """check(), with `note` added to a refusal that names a TP size (the head layout), where nobody chose that size."""
    try:
        return check()
    except QualError as exc:
        if note is None or not re.search(r"\btp=\d", str(exc)):
            raise
        raise QualError(f"{exc} ({note})") from None


def _first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"token {i}: {a[i] if i < len(a) else 'end'} vs {b[i] if i < len(b) else 'end'} ({len(a)} vs {len(b)} tokens)"


def _texts(corpus, selected, conversations: dict[str, Conversation], prompts: ChatPrompts | None) -> list[str]:
    """Each request's first prompt as text: a raw prompt as it is, a chat rendered with the template up to its first
    answer."""
    return [r.prompt if r.messages is None else
            prompts.render(conversations[r.id].messages(1, []), f"corpus {corpus.name}: request {r.id}")
            for r in selected]


def _tokenize(profile, corpus, selected, o: RunOptions, engine, arms: dict[str, ArmConfig],
              tokenizer: PromptTokenizer | None, conversations: dict[str, Conversation],
              prompts: ChatPrompts | None) -> list[EngineRequest]:
    """Prompts are tokenized once, here, so both arms receive identical token ids. Where an arm's engine tokenizes
    too (an attached server), it must agree on every prompt: matched replay needs identical token ids.

    engine None (a dry run): the local tokenizer alone, no server is asked."""
    texts = _texts(corpus, selected, conversations, prompts)
    theirs = {name: engine.tokenize(arm, texts) for name, arm in arms.items()} if engine is not None else {}
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
        if r.messages is not None:
            requests.append(conversations[r.id].request(1, prompt_ids))
        else:
            requests.append(EngineRequest(r.id, r.category, tuple(prompt_ids), o.max_tokens or r.max_tokens or profile.max_tokens))
    return requests


def _chat(profile, corpus, selected, o: RunOptions, tokenizer: PromptTokenizer | None,
          dry_run: bool, render_time: datetime) -> ChatPrompts | None:
    """The chat template chat rows render with (the tokenizer's, or --chat-template's); None without chat rows, or
    on a dry run without a local tokenizer. A chat row with no template to render it is refused, naming the row."""
    first = next((r for r in selected if r.messages is not None), None)
    if first is None:
        if o.chat_template is not None:
            raise QualError(f"--chat-template {o.chat_template}: corpus {corpus.name} has no chat rows (\"messages\") "
                            "for it to render")
        return None
    if tokenizer is None:
        if dry_run:
            return None
        raise QualError(f"corpus {corpus.name}: request {first.id} is a chat (\"messages\"), which qual renders with "
                        f"the tokenizer's chat template: the profile's tokenizer ({profile.tokenizer_path!r}) must be a "
                        "local directory")
    template = load_template(tokenizer.directory, o.chat_template)
    if template is None:
        raise QualError(f"corpus {corpus.name}: request {first.id} is a chat (\"messages\") and the tokenizer "
                        f"{profile.tokenizer_path} has no chat template (tokenizer_config.json \"chat_template\" or "
                        f"chat_template.jinja): give one with --chat-template FILE")
    if o.chat_template is not None:
        template = replace(template, source=str(Path(o.chat_template).resolve()))
    return ChatPrompts(tokenizer, replace(template, now=render_time))


def _with_checkpoints(profile, o: RunOptions):
    """The profile with --target / --draft in place of its checkpoints (absolute paths, as result.json records
    them). The tokenizer follows --target unless the profile names a local tokenizer directory of its own."""
    update = {}
    for flag, key, value in (("--target", "target", o.target), ("--draft", "draft", o.draft)):
        if value is None:
            continue
        path = Path(value).expanduser()
        if not (path / "config.json").is_file():
            raise QualError(f"{flag} {value}: not a checkpoint directory (no config.json)")
        update[key] = str(path.resolve())
    if "target" in update and not (profile.tokenizer and Path(profile.local_path(profile.tokenizer)).is_dir()):
        update["tokenizer"] = update["target"]
    return fit_positions(profile.model_copy(update=update)) if update else profile


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


def _last_turn_bound(c: Conversation, prompts: ChatPrompts, corpus) -> int:
    """A conversation's last prompt, in tokens, before the answers exist: the conversation rendered with empty
    answers, plus max_tokens for each answer (a guard; each later turn is checked again once it is built)."""
    messages = c.messages(c.turns, [""] * (c.turns - 1))
    return len(prompts.encode(messages, f"corpus {corpus.name}: request {c.request_id(c.turns)}")) + \
        (c.turns - 1) * c.max_tokens


def _check_lengths(engine, arms: dict[str, ArmConfig], corpus, selected, requests: list[EngineRequest],
                   default_max: int, conversations: dict[str, Conversation], prompts: ChatPrompts | None) -> None:
    """Every request fits every arm's context: prompt + max_tokens (+ the engine's speculative headroom); a
    conversation's last turn at its longest.

    Without token ids (a dry run with a hub tokenizer) a prompt counts as one token: max_tokens alone can
    already be impossible."""
    lengths = {r.conversation or r.id: (len(r.prompt_token_ids), r.max_tokens) for r in requests}
    for c in conversations.values():
        if c.turns > 1 and prompts is not None:
            lengths[c.row.id] = (_last_turn_bound(c, prompts, corpus), c.max_tokens)
    for r in selected:
        prompt, max_tokens = lengths.get(r.id, (1, r.max_tokens or default_max))
        for name, arm in arms.items():
            needed, limit = engine.context_needed(arm, prompt, max_tokens), engine.max_model_len(arm)
            if needed > limit:
                what = f"prompt {prompt} tokens" if r.id in lengths else "a prompt of at least 1 token"
                if r.turns > 1 and r.id in lengths:
                    what = f"its last turn's prompt, every earlier answer at max_tokens, {prompt} tokens"
                raise QualError(f"corpus {corpus.name}: request {r.id}: {what} + max_tokens {max_tokens} needs "
                                f"{needed} positions, more than the {name} arm's max_model_len {limit}")


def _corpus_notes(corpus) -> list[str]:
    """A corpus file that its manifest does not describe (edited after its import, or a broken manifest) still runs,
    as the file is (the result records its fingerprint), but not silently."""
    try:
        problems = manifest_problems(corpus)
    except QualError as exc:
        return [f"corpus {corpus.name}: {exc}"]
    if not problems:
        return []
    return [f"corpus {corpus.name}: {corpus.path} differs from its manifest ({'; '.join(problems)}); the run replays "
            "the file as it is"]


def make_plan(o: RunOptions, now: datetime | None = None, dry_run: bool = False, run_id: str | None = None,
              inventory=None, render_time: datetime | None = None) -> RunPlan:
    """Resolve profile, corpus, tokenization and both arms; raise QualError on any bad input.

    A dry run needs no local tokenizer or engine install (real deployments name hub ids); it checks the rest.
    inventory (qual.inventory.Inventory): what the machine has, asked before anything starts (default: this one's).
    render_time: the clock chat templates read (a resumed run's, from its run.json; else now, local time as
    transformers' strftime_now reads it).
    """
    render_time = render_time or datetime.now()
    profile = _with_checkpoints(load_profile(o.model), o)
    engine_name = _engine_name(o, profile)
    _validate_options(o, engine_name)
    dcps = [d or profile.dcp or DEFAULT_DCP for d in sweep.values(o, "dcp")]
    for dcp in dcps:
        tp = o.tp or profile.tp or dcp
        check_layout(tp, dcp, tp_from=None if o.tp or not profile.tp else "the profile's tp")
    gate_path = str(gate_file(o.gate) if o.gate else paths.default_gate())
    gate = load_gate(gate_path)  # a broken gate file is a usage error now, not after an hour of replay
    if o.baseline is None and needs_baseline(gate):
        r = needs_baseline(gate)[0]
        raise QualError(f"{gate_path}: rule {r.index} ({r.check}) compares with a baseline: give --baseline REF "
                        "(a run directory, a history id or history:last-pass), or mark the rule without_baseline: skip")
    history = Path(o.history) if o.history else paths.DEFAULT_HISTORY
    check_history(history, "--history")  # not a database, or read-only: refused now, not after both arms
    engine = get_engine(engine_name, inventory)
    if engine.local_checkpoints and not dry_run:
        _check_local(profile)
    dtype = o.dtype or profile.dtype
    _check_weights(profile, dtype)
    corpus = load_corpus(o.corpus if o.corpus is not None else profile.corpus)
    selected = list(corpus.requests[: o.limit] if o.limit else corpus.requests)
    default_max = o.max_tokens or profile.max_tokens
    extra = {"max_model_len": profile.max_model_len, "tokenizer": profile.tokenizer_path,
             engine_name: profile.section(engine_name)}
    if profile.weights_dtype is not None:  # the cast the profile asked for is part of what ran
        extra["weights_dtype"] = profile.weights_dtype
    for key in REVISION_KEYS:  # hub revisions: the engine applies them (or refuses), provenance records them
        if getattr(profile, key) is not None:
            extra[key] = getattr(profile, key)
    base = ArmConfig(  # what every arm shares; sweep.arms sets each arm's dcp, tp, draft_kv and dsa_topk
        engine=engine_name, model=profile.name, dcp=dcps[0], tp=o.tp or profile.tp or dcps[0],
        draft_kv=DEFAULT_DRAFT_KV, target_path=profile.target_path, draft_path=profile.draft_path,
        num_speculative_tokens=profile.num_speculative_tokens,
        sampling=Sampling(temperature=o.temperature, seed=o.seed, max_tokens=default_max),
        interleave=profile.interleave, dtype=dtype, device=o.device or profile.device or DEFAULT_DEVICE, extra=extra,
        numerics=o.numerics or profile.numerics,  # None: the engine decides (the target's default, or its build's)
    )
    # control (DCP 1), then "candidate", or a sweep's candidates; TP: --tp, else the profile's, else the DCP size
    arms = sweep.arms(o, base, dcps, DEFAULT_DRAFT_KV, lambda dcp: o.tp or profile.tp or dcp)
    if o.speedup:
        if base.draft_path is None:
            raise QualError(f"--speedup compares the candidate with plain decoding: the profile {profile.name} has no "
                            "drafter")
        arms[PLAIN_ARM] = plain_arm(arms[sweep.CANDIDATE])
    if engine.attaches:
        servers = o.servers()
        arms = {name: replace(arm, extra={**arm.extra, "server": servers[name]}) for name, arm in arms.items()}
    how = how_it_runs(o, profile, engine_name, base.device)
    # GPUs, installs, weights: everything this machine lacks, in one line, before anything starts (a dry run: listed)
    lacking = machine_problems(profile, engine, arms)
    if lacking and not dry_run:
        raise QualError(f"{profile.name} cannot run on this machine ({how}): {'; '.join(lacking)}")
    tokenizer = _local_tokenizer(profile, engine, dry_run)
    prompts = _chat(profile, corpus, selected, o, tokenizer, dry_run, render_time)
    conversations = {r.id: Conversation(r, o.max_tokens or r.max_tokens or profile.max_tokens)
                     for r in selected if r.messages is not None}
    if prompts is not None:  # the template every chat prompt was rendered with
        arms = {name: replace(arm, extra={**arm.extra, "chat_template": prompts.template.record()})
                for name, arm in arms.items()}
    requests = []
    check = engine.dry_check if dry_run else engine.preflight
    note = None if o.tp or profile.tp else "TP follows --dcp unless --tp is given"
    # not a dry run: checkpoints, head layout vs tp/dcp, installs, servers: refused before anything is written; a dry run
    # checks what needs no server, install or GPU: local checkpoints, lengths (local tokenizer)
    arms = {name: _noting_tp(lambda a=arm: check(a, o.requested()), note) for name, arm in arms.items()}
    if not dry_run or tokenizer is not None:  # a dry run asks no server: the local tokenizer alone
        requests = _tokenize(profile, corpus, selected, o, None if dry_run else engine, arms, tokenizer, conversations,
                             prompts)
    _check_lengths(engine, arms, corpus, selected, requests, default_max, conversations, prompts)
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    label = "sweep" if sweep.swept(o) else f"dcp{dcps[0]}"
    out_dir = Path(o.out) if o.out else paths.REPORTS_DIR / f"{stamp}-{profile.name}-{label}"
    check_path_name(out_dir, "--out")  # a name the file system refuses (ENAMETOOLONG): exit 2 before any work
    corpus_info = {"name": corpus.name, "path": str(corpus.path), "fingerprint": corpus.fingerprint, "count": len(selected),
                   "total_in_corpus": len(corpus.requests)}
    plan = RunPlan(o, profile.name, corpus_info, requests, arms, gate_path, out_dir, history, run_id or uuid.uuid4().hex,
                   conversations=[c for c in conversations.values() if c.turns > 1], prompts=prompts,
                   request_ids=request_ids(selected), profile_path=profile.path, how=how, lacking=lacking,
                   inventory=inventory, render_time=render_time if prompts is not None else None, gate=gate)
    plan.engine_version = engine.version(arms[plan.candidates[0]])
    plan.notes = _corpus_notes(corpus) + list(dict.fromkeys(n for arm in arms.values() for n in engine.notes(arm)))
    if o.baseline_any and o.baseline is None:
        raise QualError("--baseline-any without --baseline: it lets a baseline of another configuration serve")
    if o.axis != "date" and o.baseline is None:
        raise QualError(f"--axis {o.axis} without --baseline: it says what the report's strip of the series' recorded "
                        "nights runs along, which only a run against a baseline has")
    if o.baseline_required and o.baseline != LAST_PASS:
        raise QualError(f"--baseline-required applies to --baseline {LAST_PASS} (a series' first night, which has "
                        "nothing to compare with, is then exit 2)")
    if o.baseline is not None:  # found and checked now: a baseline that cannot serve is exit 2 before any arm runs
        plan.baseline = resolve(o.baseline, history, plan.configuration, o.baseline_any, o.baseline_required,
                                plan.notes)
        plan.first_night = plan.baseline is None
        if plan.baseline is not None:
            check_match(plan.baseline, arms, corpus.fingerprint, plan.request_ids)
    if not dry_run:
        plan.inputs = run_inputs(plan, profile.path)
    return plan


@dataclass(frozen=True)
class SavedPlan:
    """What run.json says about a started run (for --resume)."""

    options: RunOptions
    fingerprint: str  # the corpus's, when the run started
    run_id: str | None  # None: written by a qual that kept no run id
    inputs: dict | None = None  # None: written by a qual that recorded no inputs (qual.harness.inputs)
    render_time: datetime | None = None  # None: no chat rows, or written by a qual that kept no clock
    notes: tuple[str, ...] = ()  # what the user hears before the resumed run (stderr: "warning:")
    journals_sealed: bool = False  # its journals' lines carry their digests (qual.harness.journal)


def load_plan(run_dir: Path) -> SavedPlan:
    """run.json of a previous run, validated key by key (a hand-edited or truncated file is exit 2)."""
    path = run_dir / PLAN_FILE
    if not path.is_file():
        if run_dir.is_dir() and any(is_leftover(p.name) and p.name.startswith(f".{PLAN_FILE}.") for p in run_dir.iterdir()):
            raise QualError(f"--resume {run_dir}: the run stopped before its {PLAN_FILE} was written whole, so nothing "
                            f"ran: start it again (`qual run ... --out {shown.safe(run_dir)}`)")
        raise QualError(f"--resume {run_dir}: no {PLAN_FILE} there (not a qual run directory)")
    try:
        data = load_json(read_config_text(path), str(path))
    except OSError as exc:
        raise QualError(f"{path}: unreadable ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise QualError(f"{path}: expected a JSON object")
    unsealed = check_sealed(data, str(path))
    for key in ("options", "corpus"):
        if not isinstance(data.get(key), dict):
            raise QualError(f"{path}: {key}: {'missing' if key not in data else 'must be an object'}")
    fingerprint = data["corpus"].get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint.startswith("sha256:"):
        raise QualError(f"{path}: corpus.fingerprint: {'missing' if fingerprint is None else 'not a sha256: fingerprint'}")
    run_id = data.get("run_id")
    if run_id is not None and (not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id)):
        raise QualError(f"{path}: run_id: {shown.safe(repr(run_id)[:60])} is not a run id (letters, digits, '.', '_' "
                        "and '-', 1 to 64 of them, not starting with '.': it names history rows and folders)")
    try:
        options = RunOptions(**data["options"])
    except ValidationError as exc:
        raise QualError(f"{path}: {describe_error(exc, 'options')}") from None
    inputs = data.get("inputs")
    if inputs is not None and not isinstance(inputs, dict):
        raise QualError(f"{path}: inputs: must be an object")
    render_time = data.get("render_time")
    if render_time is not None:
        try:
            render_time = datetime.fromisoformat(render_time)
        except (TypeError, ValueError):
            raise QualError(f"{path}: render_time: not a time ({shown.safe(str(render_time)[:40])})") from None
    if data.get("journals_sealed") not in (None, True):
        raise QualError(f"{path}: journals_sealed: must be true where present")
    return SavedPlan(options, fingerprint, run_id, inputs, render_time, (unsealed,) if unsealed else (),
                     data.get("journals_sealed") is True)
