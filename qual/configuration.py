"""The configuration key: what makes two runs the same experiment, defined once for every series.

History trends group on it, the report's "runs of this configuration" strip selects on it, `history:last-pass`
and pins select on it, and a baseline of another key is refused unless `--baseline-any` forces it
(docs/statistics.md, "Baselines"). Two runs share a key when every field agrees: the engine and its version, what
the checkpoints hold (a drafter swapped in at the same path is a new key), the parallel layout, the draft-KV and
sparse top-k modes and the DCP merge path, the numeric settings (dtype, device, numerics), and the requests replayed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from qual.options import DEFAULT_DCP_COMM, DEFAULT_NUMERICS
from qual.userfiles import load_json

NO_IDENTITY = "unknown"  # a run recorded before qual kept checkpoint identities, or a checkpoint it cannot read


@dataclass(frozen=True)
class ConfigurationKey:
    model: str
    engine: str
    engine_version: str
    target: str  # the target checkpoint's identity (qual.checkpoints.identity.identity_label)
    draft: str  # the drafter's; "none" for a run without one
    tp: int
    dcp: int  # the candidate's (the control is DCP 1)
    interleave: int
    draft_kv: str
    dsa_topk: str  # "none" for a target without sparse attention
    dcp_comm: str  # how DCP partial attentions merge (dcp_comm_of); "unknown" where the engine does not say
    numerics: str  # how the target computes (qual.options.NUMERICS; numerics_of); "none" where it has one form only
    dtype: str
    device: str
    corpus_fingerprint: str
    n_requests: int  # the replayed selection: the first n requests of the corpus (--limit)
    max_tokens: int
    temperature: float
    seed: int
    num_speculative_tokens: int

    @classmethod
    def of(cls, candidate: dict, corpus_fingerprint: str, n_requests: int, engine_version: str | None,
           checkpoints: dict | None) -> "ConfigurationKey":
        """From the candidate arm's config (result.json arms.candidate.config), the corpus replayed, the engine's
        version and the checkpoints' identities ({"target": label, "draft": label}; None: not recorded)."""
        s = candidate.get("sampling") or {}
        ids = checkpoints or {}
        return cls(
            model=str(candidate.get("model")), engine=str(candidate.get("engine")),
            engine_version=str(engine_version or NO_IDENTITY),
            target=str(ids.get("target") or NO_IDENTITY),
            draft=str(ids.get("draft") or ("none" if candidate.get("draft_path") is None else NO_IDENTITY)),
            tp=int(candidate.get("tp", 0)), dcp=int(candidate.get("dcp", 0)),
            interleave=int(candidate.get("interleave", 1)), draft_kv=str(candidate.get("draft_kv")),
            dsa_topk=str(candidate.get("dsa_topk") or "none"), dcp_comm=dcp_comm_of(candidate),
            numerics=numerics_of(candidate),
            dtype=str(candidate.get("dtype")),
            device=str(candidate.get("device")), corpus_fingerprint=str(corpus_fingerprint), n_requests=int(n_requests),
            max_tokens=int(s.get("max_tokens", 0)), temperature=float(s.get("temperature", 0.0)),
            seed=int(s.get("seed", 0)), num_speculative_tokens=int(candidate.get("num_speculative_tokens", 0)),
        )

    @classmethod
    def of_result(cls, result) -> "ConfigurationKey":
        """The key of a finished run (a qual.result.Result): its candidate arm as it ran."""
        cand = result.candidate
        checkpoints = cand.provenance.checkpoints if cand.provenance is not None else None
        return cls.of(cand.config, result.corpus.fingerprint, result.corpus.count, cand.engine_version,
                      {arm: (c or {}).get("identity") for arm, c in (checkpoints or {}).items()})

    @classmethod
    def from_key(cls, key: str) -> "ConfigurationKey":
        data = load_json(key, "configuration key")
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def key(self) -> str:
        """Canonical text (history's `configuration` column)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def differences(self, other: "ConfigurationKey", unknown_matches: bool = False) -> list[tuple[str, object, object]]:
        """(field, self's value, other's value) for each field that differs, in declaration order. unknown_matches:
        a field self does not know yet (an attached server's version before a dry run asks it) matches anything."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name)) for f in fields(self)
                if getattr(self, f.name) != getattr(other, f.name)
                and not (unknown_matches and getattr(self, f.name) == NO_IDENTITY)]

    def label(self) -> str:
        """One line naming the series (trend output, plots, the published site)."""
        kv = (f" kv={self.draft_kv}" + (f" dsa={self.dsa_topk}" if self.dsa_topk != "none" else "")
              + (f" merge={self.dcp_comm}" if self.dcp_comm not in (NO_IDENTITY, DEFAULT_DCP_COMM) else "")
              + (f" numerics={self.numerics}" if self.numerics != "none" else ""))
        il = f" il{self.interleave}" if self.interleave != 1 else ""
        return (f"{self.model} {self.engine_version} dcp{self.dcp} tp{self.tp}{il}{kv} K={self.num_speculative_tokens} "
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


def numerics_of(candidate: dict) -> str:
    """How an arm's target computed (its config's `numerics`), "none" where its target has one form. An arm recorded
    before numerics were a setting computed the only form there was: for the one target with a choice (GLM-5, the
    one with sparse attention, so a recorded dsa_topk) on the embedded runtime, that is the default form, which a run
    of today without --numerics records."""
    if "numerics" not in candidate and candidate.get("dsa_topk") and candidate.get("engine") == "reference":
        return DEFAULT_NUMERICS
    return str(candidate.get("numerics") or "none")


def _short(identity: str) -> str:
    """sha256:0123456789ab for a hash (12 hex digits), the text for anything else."""
    return identity[:19] if identity.startswith("sha256:") else identity


def describe_differences(diffs: list[tuple[str, object, object]], left: str = "this run", right: str = "baseline") -> str:
    """"draft: this run sha256:ab.., baseline sha256:cd..; n_requests: ..." for a refusal's one line."""
    return "; ".join(f"{name}: {left} {_short(str(a))}, {right} {_short(str(b))}" for name, a, b in diffs)
