"""Model profiles (configs/models/<name>.yaml): what to load and the defaults `qual run` uses for it.

Validated on load: a wrong type, an unknown key (in any section), an impossible value is a one-line error
naming the file and the key. Each engine's section (`reference:`, `vllm:`) is validated by that engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, PrivateAttr

from qual import paths
from qual.checkpoints.config import max_positions, read_config
from qual.checkpoints.weights import WEIGHT_DTYPES
from qual.engines.registry import ENGINES, engine_class
from qual.errors import QualError
from qual.options import DEFAULT_DTYPE, Device, Dtype, Numerics
from qual.userfiles import check_path_name, load_yaml
from qual.validation import Section, parse_section, read_config_text, schema_document, tidy_schema

_MOVED = {"block_size": "reference", "kv_memory_mib": "reference"}  # keys that belong to one engine's section


class ModelProfile(Section):
    """One profile: what to load, and how `qual run --model NAME` runs it where no flag says otherwise (a flag wins,
    then the profile, then qual's default)."""

    name: str
    """The profile's name (default: the file's name without .yaml)"""
    engine: Literal[tuple(ENGINES)] | None = None
    """What runs the arms unless --engine says otherwise: reference (qual's embedded runtime, the default), vllm
    (servers qual starts) or attach (servers already running)"""
    device: Device | None = None
    """Where the arms run unless --device says otherwise: cpu (the default), cuda or cuda:N; on cuda an arm needs one
    GPU a TP rank, and the arms run one after the other on the same GPUs"""
    gpu_memory_gib: PositiveFloat | None = None
    """Memory each of those GPUs must have, in GiB, where the engine has no memory plan for the target or cannot read
    its config.json yet (the weights not downloaded); the engine's plan decides where it has one (qual doctor --model
    NAME shows which)"""
    target: str = Field(min_length=1)
    """The target checkpoint: a directory (relative: to this file's folder, then qual's data folder) or a hub id, read
    from the local Hugging Face cache (runs are offline)"""
    draft: str | None = None
    """The DFlash drafter checkpoint, as target; unset: no drafter"""
    target_revision: str | None = Field(None, min_length=1)
    """The hub revision (branch, tag or commit) of a target given as a hub id: passed to the engine and recorded in
    provenance; refused for a local directory (its content identifies it)"""
    draft_revision: str | None = Field(None, min_length=1)
    """The hub revision of a drafter given as a hub id, as target_revision"""
    num_speculative_tokens: PositiveInt
    """K: tokens the drafter proposes a step (a DFlash block is K + 1)"""
    description: str = ""
    """One line saying what the pair is"""
    tokenizer: str | None = None
    """The tokenizer qual tokenizes prompts with, as target (default: the target's)"""
    tp: PositiveInt | None = None
    """TP size of both arms unless --tp says otherwise; unset: the candidate's DCP size"""
    dcp: PositiveInt | None = None
    """The candidate's DCP size unless --dcp says otherwise; unset: 4 (the control is DCP 1)"""
    interleave: PositiveInt = 1
    """Tokens a DCP rank holds in a row before the next rank's (cp_kv_cache_interleave_size)"""
    dtype: Dtype = DEFAULT_DTYPE
    """The floating-point type the arms compute in unless --dtype says otherwise"""
    weights_dtype: Literal[WEIGHT_DTYPES] | None = None
    """The type the checkpoints store, where a cast to dtype that qual would refuse is meant (float16 or int8 weights
    run in float32): the arm records it; unset: only lossless or intended casts run"""
    numerics: Numerics | None = None
    """How a GLM-5 target computes unless --numerics says otherwise: exact (as written, the default), vllm (as vLLM's
    kernels compute it) or vllm-hopper (with DeepGEMM's power-of-two scales too; docs/glm5.md, "Numerics"); a target
    with one form (Qwen3) refuses it"""
    corpus: str = Field("humaneval", min_length=1)
    """The corpus a run replays unless --corpus says otherwise (qual corpus list)"""
    max_tokens: PositiveInt = 64
    """Most new tokens a request generates, where neither --max-tokens nor its corpus row says"""
    max_model_len: PositiveInt = 2048
    """Most positions a request may use (prompt and output); unset: 2048, or a local target's max_position_embeddings if
    smaller"""
    vllm: dict = Field(default_factory=dict)
    """Options of the vLLM servers qual starts (--engine vllm)"""
    reference: dict = Field(default_factory=dict)
    """Options of the embedded runtime (--engine reference)"""
    attach: dict = Field(default_factory=dict)
    """Options for servers qual did not start (--engine attach)"""
    path: str = ""
    """The file the profile came from (set by qual, not a key of the file)"""
    _max_model_len_given: bool = PrivateAttr(False)  # the file sets max_model_len (else: a default, fitted)

    def local_path(self, value: str | None) -> str | None:
        """A relative path resolves against the profile's folder, then qual's data folder; anything else (a
        hub id) is passed through unchanged."""
        if value is None:
            return None
        p = Path(value)
        if p.is_absolute():
            return str(p)
        for base in (Path(self.path).parent, paths.DATA_DIR):
            if (base / p).exists():
                return str((base / p).resolve())
        return value

    @property
    def target_path(self) -> str:
        return self.local_path(self.target)

    @property
    def draft_path(self) -> str | None:
        return self.local_path(self.draft)

    @property
    def tokenizer_path(self) -> str:
        return self.local_path(self.tokenizer) or self.target_path

    def section(self, engine: str) -> dict:
        """This profile's section for an engine (already validated)."""
        return dict(getattr(self, engine))


def profile_schema() -> dict:
    """The JSON Schema of a profile file: ModelProfile's keys, each engine's section as that engine validates it (the
    models that validate a profile, so the two cannot disagree)."""
    schema = ModelProfile.model_json_schema()
    props = schema["properties"]
    del props["path"]  # set by qual from where the file was found
    for name in ENGINES:
        props[name] = {**engine_class(name).options_schema(), "description": props[name]["description"]}
    schema["required"] = [k for k in schema["required"] if k != "name"]  # the file's name where it gives none
    return schema_document("qual model profile (configs/models/NAME.yaml)", tidy_schema(schema, ("title",)))


def available_profiles() -> list[str]:
    """The profiles found by name ($QUAL_ROOT, the checkout's configs/models, the package's copy)."""
    return list(paths.available("profile"))


def _read(path: Path) -> dict:
    try:
        data = load_yaml(read_config_text(path), str(path)) or {}
    except OSError as exc:
        raise QualError(f"{path}: unreadable ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise QualError(f"{path}: a profile must be a mapping")
    return data


def fit_positions(profile: ModelProfile) -> ModelProfile:
    """max_model_len within what a local target was built for (its config.json's max_position_embeddings), as vLLM
    has it: a profile that sets more is refused (the embedded runtime sizes its key views by max_model_len, so
    10**12 would be an engine failure, an allocation of terabytes, instead of this file's mistake); one that sets
    none gets the default, or the target's limit where that is smaller. Called again when --target replaces the
    profile's target (qual.harness.plan): the same check for the same directory however it is named."""
    given = profile._max_model_len_given
    if not given:
        profile = profile.model_copy(update={"max_model_len": ModelProfile.model_fields["max_model_len"].default})
    target = Path(profile.target_path)
    if not (target / "config.json").is_file():
        return profile  # a hub id, or a checkpoint the plan reports missing
    limit = max_positions(read_config(target))
    if limit is None or profile.max_model_len <= limit:
        return profile
    if not given:
        return profile.model_copy(update={"max_model_len": limit})
    raise QualError(f"{profile.path}: max_model_len: {profile.max_model_len} is more positions than the target was "
                    f"built for (max_position_embeddings {limit} in {target / 'config.json'})")


def load_profile(name_or_path: str) -> ModelProfile:
    """A profile by name (configs/models/<name>.yaml, searched as qual.paths says) or by path."""
    check_path_name(name_or_path, "--model")
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        found = paths.find("profile", name_or_path) if len(path.parts) == 1 else None
        if found is None:
            raise QualError(f"unknown model {name_or_path!r}; available: {', '.join(available_profiles())}")
        path = found.path
    data = _read(path)
    for key, section in _MOVED.items():
        if key in data:
            raise QualError(f"{path}: {key}: belongs under `{section}:` (it applies to that engine only)")
    data.setdefault("name", path.stem)
    if "path" in data:
        raise QualError(f"{path}: path: unknown key")
    profile = parse_section(ModelProfile, {**data, "path": str(path)}, str(path))
    sections = {name: engine_class(name).parse_options(data.get(name) or {}, str(path)) for name in ENGINES}
    _check_revisions(profile)
    profile._max_model_len_given = "max_model_len" in data
    return fit_positions(profile).model_copy(update=sections)


def _check_revisions(profile: ModelProfile) -> None:
    """A hub revision belongs to a hub id: a local directory is what it holds (its content hash identifies it)."""
    for key, checkpoint in (("target_revision", profile.target_path), ("draft_revision", profile.draft_path)):
        if getattr(profile, key) is None:
            continue
        if checkpoint is None:
            raise QualError(f"{profile.path}: {key}: the profile names no drafter")
        if Path(checkpoint).exists():
            raise QualError(f"{profile.path}: {key}: {checkpoint} is a local directory, identified by its content; "
                            "a hub revision applies to a hub id")
