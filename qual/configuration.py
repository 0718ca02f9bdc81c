"""The configuration key: what makes two runs the same experiment, defined once for every series.

A series is every night of one key: history trends group on it, the report's "runs of this configuration" strip
selects on it, `history:last-pass` and pins select on it (docs/statistics.md, "Series" and "Baselines"). The key
names the measurement: the model profile, what the checkpoints hold (a drafter swapped in at the same path is a new
key), the engine that measures, the parallel layout, the draft-KV, sparse top-k and numerics modes, the DCP merge
path, the dtype and the kind of device, the requests replayed and how they are sampled. The software under test is
not in it:
the engine's version and build, qual's version and commit, torch, the driver, the GPU model and the host are each
night's facts (qual.nights), the axis a series is plotted along, so a night after an engine upgrade is compared with
the last pass of its own series.

The fields are declared once, below, each with where it is read from and its value where a run or row recorded
none: adding a field is one line. A history keyed with another set of fields is keyed again when qual opens it to
write (qual.history.store), every row from the key it stored.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from qual.errors import QualError
from qual.options import DEFAULT_DCP_COMM
from qual.userfiles import load_json

NO_IDENTITY = "unknown"  # a run recorded before qual kept checkpoint identities, or a checkpoint it cannot read
_REQUIRED = object()  # a field every key must carry (a stored key without it is damaged)
_STORED = {"str": (str,), "int": (int,), "float": (int, float)}  # the JSON types a stored key's field may have


@dataclass(frozen=True)
class _Source:
    """Where a field's value comes from: read(candidate arm config, run facts), and its value when absent (a
    _PerEngine default: the value for the arm's engine)."""

    read: Callable[[dict, dict], Any]
    kind: Callable[[Any], Any]
    default: Any = _REQUIRED

    def absent(self, arm: dict) -> Any:
        """The value where the arm (or a stored key: both name the engine) recorded none."""
        return self.default.of(arm.get("engine")) if isinstance(self.default, _PerEngine) else self.default


@dataclass(frozen=True)
class _PerEngine:
    """A default that depends on the engine: the embedded runtime's choice, else what a served vLLM build does."""

    reference: Any
    served: Any

    def of(self, engine: Any) -> Any:
        return self.reference if engine == "reference" else self.served


def _arm(key: str, kind: Callable[[Any], Any] = str, default: Any = _REQUIRED):
    """A field of the candidate arm's config (result.json arms.candidate.config)."""
    return field(metadata={"source": _Source(lambda arm, run: arm.get(key), kind, default)})


def _sampling(key: str, kind: Callable[[Any], Any], default: Any):
    return field(metadata={"source": _Source(lambda arm, run: (arm.get("sampling") or {}).get(key), kind, default)})


def _run(key: str, kind: Callable[[Any], Any] = str, default: Any = _REQUIRED):
    """A fact of the run rather than of an arm: the corpus replayed, the checkpoints' identities."""
    return field(metadata={"source": _Source(lambda arm, run: run.get(key), kind, default)})


def device_kind(device: Any) -> str:
    """cpu, or cuda for any CUDA device (cuda:1 is the same experiment as cuda:0)."""
    text = str(device)
    return text.split(":", 1)[0] if text.startswith("cuda") else text


@dataclass(frozen=True)
class ConfigurationKey:
    model: str = _arm("model")
    engine: str = _arm("engine")  # reference | vllm | attach: which implementation measures (not its version)
    target: str = _run("target", default=NO_IDENTITY)  # the target checkpoint's identity (checkpoints.identity)
    draft: str = _run("draft", default=NO_IDENTITY)  # the drafter's; "none" for a run without one
    tp: int = _arm("tp", int)
    dcp: int = _arm("dcp", int)  # the candidate's (the control is DCP 1)
    interleave: int = _arm("interleave", int, 1)
    draft_kv: str = _arm("draft_kv")
    dsa_topk: str = _arm("dsa_topk", str, "none")  # "none" for a target without sparse attention
    # exact | vllm | vllm-hopper; where an arm records none: exact in the embedded runtime (a target that computes one
    # way, as written), build under vllm or attach (the served build's kernels decide; qual chooses nothing there)
    numerics: str = _arm("numerics", str, _PerEngine(reference="exact", served="build"))
    dcp_comm: str = _run("dcp_comm", default=NO_IDENTITY)  # how DCP partial attentions merge (dcp_comm_of)
    dtype: str = _arm("dtype")
    device: str = _arm("device", device_kind)  # the kind: cpu | cuda
    corpus_fingerprint: str = _run("corpus_fingerprint")
    n_requests: int = _run("n_requests", int)  # the replayed selection: the first n requests of the corpus (--limit)
    max_tokens: int = _sampling("max_tokens", int, 0)
    temperature: float = _sampling("temperature", float, 0.0)
    seed: int = _sampling("seed", int, 0)
    num_speculative_tokens: int = _arm("num_speculative_tokens", int, 0)

    @classmethod
    def of(cls, candidate: dict, corpus_fingerprint: str, n_requests: int, checkpoints: dict | None) -> "ConfigurationKey":
        """From the candidate arm's config (result.json arms.candidate.config), the corpus replayed and the checkpoints'
        identities ({"target": label, "draft": label}; None: not recorded)."""
        ids = checkpoints or {}
        run = {"corpus_fingerprint": corpus_fingerprint, "n_requests": n_requests,
               "target": ids.get("target"),
               "draft": ids.get("draft") or ("none" if candidate.get("draft_path") is None else None),
               "dcp_comm": dcp_comm_of(candidate)}
        values = {}
        for f in fields(cls):
            source: _Source = f.metadata["source"]
            raw = source.read(candidate, run)
            values[f.name] = source.kind(raw if raw is not None or source.default is _REQUIRED else source.absent(candidate))
        return cls(**values)

    @classmethod
    def of_result(cls, result) -> "ConfigurationKey":
        """The key of a finished run (a qual.result.Result): its candidate arm as it ran."""
        cand = result.candidate
        checkpoints = cand.provenance.checkpoints if cand.provenance is not None else None
        return cls.of(cand.config, result.corpus.fingerprint, result.corpus.count,
                      {arm: (c or {}).get("identity") for arm, c in (checkpoints or {}).items()})

    @classmethod
    def from_key(cls, key: str) -> "ConfigurationKey":
        """A key as the history stored it. A field it lacks (added to the key after the row was keyed) takes its
        default; a field the key no longer has (the engine version, before it left the key) is ignored. ValueError:
        not a key (not JSON, not an object, a required field missing or of another type)."""
        try:  # the bounded loader: a stored key is text anyone may have edited
            data = load_json(key, "configuration key") if isinstance(key, str) else None
        except QualError as exc:
            raise ValueError(str(exc)) from None
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        values = {}
        for f in fields(cls):
            source: _Source = f.metadata["source"]
            if f.name not in data or data[f.name] is None:
                if source.default is _REQUIRED:
                    raise ValueError(f"no {f.name!r}")
                values[f.name] = source.absent(data)
                continue
            value = data[f.name]
            if type(value) not in _STORED[f.type] or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"{f.name}: expected {f.type}, got {json.dumps(value)[:40]}")
            values[f.name] = source.kind(value)
        return cls(**values)

    def key(self) -> str:
        """Canonical text (history's `configuration` column)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def differences(self, other: "ConfigurationKey", unknown_matches: bool = False) -> list[tuple[str, object, object]]:
        """(field, self's value, other's value) for each field that differs, in declaration order. unknown_matches:
        a field self does not know yet (a checkpoint qual could not read) matches anything."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name)) for f in fields(self)
                if getattr(self, f.name) != getattr(other, f.name)
                and not (unknown_matches and getattr(self, f.name) == NO_IDENTITY)]

    def label(self) -> str:
        """One line naming the series (trend output, plots, the published site)."""
        modes = (f" kv={self.draft_kv}" + (f" dsa={self.dsa_topk}" if self.dsa_topk != "none" else "")
                 + (f" numerics={self.numerics}" if self.numerics != _default("numerics", self.engine) else "")
                 + (f" merge={self.dcp_comm}" if self.dcp_comm not in (NO_IDENTITY, DEFAULT_DCP_COMM) else ""))
        il = f" il{self.interleave}" if self.interleave != 1 else ""
        return (f"{self.model} {self.engine} dcp{self.dcp} tp{self.tp}{il}{modes} K={self.num_speculative_tokens} "
                f"T={self.temperature:g} {self.dtype} {self.device} n={self.n_requests} max_tokens={self.max_tokens} "
                f"corpus {_short(self.corpus_fingerprint)} target {_short(self.target)} draft {_short(self.draft)}")

    def describe(self) -> str:
        """Every field, for messages that must say exactly which configuration."""
        return ", ".join(f"{k} {v}" for k, v in asdict(self).items())


def dcp_comm_of(candidate: dict) -> str:
    """The merge path of DCP partial attentions an arm's config (result.json arms.<arm>.config) ran with: its engine
    section's `dcp_comm` (the reference engine's) or `dcp_comm_backend` (vLLM's flag), NO_IDENTITY where the section
    names none (vLLM's own default, an attached server, a run recorded before the reference engine had the option)."""
    section = (candidate.get("extra") or {}).get(str(candidate.get("engine"))) or {}
    if not isinstance(section, dict):
        return NO_IDENTITY
    return str(section.get("dcp_comm") or section.get("dcp_comm_backend") or NO_IDENTITY)


def field_names() -> tuple[str, ...]:
    """The key's fields, in order (the history keys its rows again when this changes)."""
    return tuple(f.name for f in fields(ConfigurationKey))


def _default(name: str, engine: str | None = None) -> Any:
    """A field's value where a run recorded none (for the engine, where that depends on it)."""
    return next(f.metadata["source"].absent({"engine": engine}) for f in fields(ConfigurationKey) if f.name == name)


# Fields in which a series may differ from the one before it and still be compared with that series' last pass by
# default: what the checkpoints hold (a drafter retrained, another target: a new series whose first night must not
# quietly become its own baseline) and the selection of the same corpus (compared on the requests both ran).
SUCCESSOR_FIELDS = ("target", "draft", "n_requests")


def is_successor(tonight: "ConfigurationKey", earlier: "ConfigurationKey") -> bool:
    """earlier's series is one tonight's may be compared with by default: they differ in SUCCESSOR_FIELDS alone. A
    field earlier does not know is no difference here: a night recorded before qual kept that field (a history from an
    older qual, keyed again with NO_IDENTITY there) is the series before the first night after the upgrade, which is
    held to its level rather than passing on the paired gate alone; the differences are still recorded and shown."""
    diffs = tonight.differences(earlier, unknown_matches=True)
    known = [name for name, _, theirs in diffs if theirs != NO_IDENTITY]
    return bool(diffs) and all(name in SUCCESSOR_FIELDS for name in known)


def _short(identity: str) -> str:
    """sha256:0123456789ab for a hash (12 hex digits), the text for anything else."""
    return identity[:19] if identity.startswith("sha256:") else identity


def describe_differences(diffs: list[tuple[str, object, object]], left: str = "this run", right: str = "baseline") -> str:
    """"draft: this run sha256:ab.., baseline sha256:cd..; n_requests: ..." for a refusal's one line."""
    return "; ".join(f"{name}: {left} {_short(str(a))}, {right} {_short(str(b))}" for name, a, b in diffs)
