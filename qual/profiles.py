"""Model profiles (configs/models/<name>.yaml): what to load and the defaults `qual run` uses for it.

Validated on load: a wrong type, an unknown key (in any section), an impossible value is a one-line error
naming the file and the key. Each engine's section (`reference:`, `vllm:`) is validated by that engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt

from qual import paths
from qual.checkpoints.config import max_positions, read_config
from qual.checkpoints.weights import WEIGHT_DTYPES
from qual.engines.registry import ENGINES, engine_class
from qual.errors import QualError
from qual.options import DEFAULT_DTYPE, Dtype, Numerics
from qual.userfiles import check_path_name, load_yaml
from qual.validation import Section, parse_section, read_config_text

_MOVED = {"block_size": "reference", "kv_memory_mib": "reference"}  # keys that belong to one engine's section


class ModelProfile(Section):
    """One profile. `tp` and `dcp` are the defaults of `qual run --model NAME`."""

    name: str
    target: str = Field(min_length=1)
    draft: str | None = None
    # The hub revisions (a branch, tag or commit) of a target or drafter given as a hub id: passed to the engine
    # and recorded in provenance. A local directory is identified by its content; a revision for one is refused.
    target_revision: str | None = Field(None, min_length=1)
    draft_revision: str | None = Field(None, min_length=1)
    num_speculative_tokens: PositiveInt
    description: str = ""
    tokenizer: str | None = None
    tp: PositiveInt | None = None  # None: the candidate's DCP size
    dcp: PositiveInt | None = None  # the candidate's DCP size (None: 4)
    interleave: PositiveInt = 1
    dtype: Dtype = DEFAULT_DTYPE
    # The dtype the checkpoints store, when a cast to `dtype` that qual would refuse is meant (float16 or
    # int8 weights run in float32): the arm records it. Unset: only lossless or intended casts run.
    weights_dtype: Literal[WEIGHT_DTYPES] | None = None
    # How a target with a choice computes (qual.options.NUMERICS; docs/glm5.md, "Numerics"); unset: the target's
    # default (DEFAULT_NUMERICS). A target with one form only refuses it, as `--numerics` is refused there.
    numerics: Numerics | None = None
    corpus: str = Field("humaneval", min_length=1)
    max_tokens: PositiveInt = 64
    max_model_len: PositiveInt = 2048  # unset: this, or the local target's max_position_embeddings if smaller
    vllm: dict = Field(default_factory=dict)  # validated by the vLLM engine
    reference: dict = Field(default_factory=dict)  # validated by the reference engine
    attach: dict = Field(default_factory=dict)  # validated by the attach engine (servers qual did not start)
    path: str = ""  # the file it came from (not a key of the file)

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


def available_profiles() -> list[str]:
    return sorted(p.stem for p in paths.PROFILE_DIR.glob("*.yaml"))


def _read(path: Path) -> dict:
    try:
        data = load_yaml(read_config_text(path), str(path)) or {}
    except OSError as exc:
        raise QualError(f"{path}: unreadable ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise QualError(f"{path}: a profile must be a mapping")
    return data


def _positions(profile: ModelProfile, given: bool) -> ModelProfile:
    """max_model_len within what a local target was built for (its config.json's max_position_embeddings), as vLLM
    has it: a profile that sets more is refused (the embedded runtime sizes its key views by max_model_len, so
    10**12 would be an engine failure, an allocation of terabytes, instead of this file's mistake); one that sets
    none gets the default, or the target's limit where that is smaller."""
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
    """A profile by name (configs/models/NAME.yaml) or by path."""
    check_path_name(name_or_path, "--model")
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = paths.PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise QualError(f"unknown model {name_or_path!r}; available: {', '.join(available_profiles())}")
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
    return _positions(profile, "max_model_len" in data).model_copy(update=sections)


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
