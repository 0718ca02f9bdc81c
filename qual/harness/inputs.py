"""What a run depends on, recorded in run.json when it starts, so that `--resume` runs exactly the run that started:
the options, the profile and gate files, the corpus, the checkpoints, both arms as planned and the planned requests.
A resume recomputes them and refuses (exit 2, naming what changed) when any differs; run.json carries a digest of its
own content, so an edit to it is refused too."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from qual.checkpoints.identity import checkpoint_identity, checkpoint_record
from qual.engines.registry import engine_class
from qual.errors import QualError
from qual.provenance import file_sha256

SHOWN = 5  # differences named in the refusal


def _digest(obj) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def run_inputs(plan, profile_path: str) -> dict:
    """The identity of everything the plan was made from (plan: a RunPlan)."""
    options = {k: list(v) if isinstance(v, tuple) else v  # a sweep's lists, as run.json holds them
               for k, v in asdict(plan.options).items() if k not in ("out", "history")}  # where, not what
    if not options.get("speedup"):  # as a run started before the flag existed recorded it
        options.pop("speedup", None)
    candidate = plan.arms[plan.candidates[0]]  # a sweep's candidates share their checkpoints
    return {
        "options": options,
        "profile": {"path": profile_path, "sha256": file_sha256(profile_path)},
        "gate": {"path": plan.gate_path, "sha256": plan.gate.sha256},
        "corpus": plan.corpus_info["fingerprint"],
        "checkpoints": {"target": checkpoint_identity(candidate.target_path),
                        "draft": checkpoint_identity(candidate.draft_path),
                        "tokenizer": checkpoint_identity(candidate.extra.get("tokenizer"))},
        "arms": {name: arm.to_json() for name, arm in plan.arms.items()},
        "requests": _digest([[r.id, list(r.prompt_token_ids), r.max_tokens] for r in plan.requests]),
    }


ATTACHED = "not observed (an attached server loaded its own checkpoints)"


def checkpoint_records(arm: dict) -> dict:
    """Provenance's record of an arm's target and drafter (path, hub revision, identity: qual.checkpoints.identity).
    An attached server's checkpoints are whatever it loaded: the profile's paths say nothing about them."""
    extra = arm.get("extra") or {}
    records = {"target": checkpoint_record(arm.get("target_path"), extra.get("target_revision")),
               "draft": checkpoint_record(arm.get("draft_path"), extra.get("draft_revision"))}
    if engine_class(str(arm.get("engine"))).attaches:
        records = {name: {**rec, "identity": ATTACHED} if rec else None for name, rec in records.items()}
    return records


def identities(records: dict) -> dict:
    """{"target": identity, "draft": identity or None}: what the configuration key takes from the records."""
    return {name: (rec or {}).get("identity") for name, rec in records.items()}


def seal(data: dict) -> dict:
    """run.json's content with a digest of itself (key "sealed")."""
    return {**data, "sealed": _digest({k: v for k, v in data.items() if k != "sealed"})}


def check_sealed(data: dict, where: str) -> str | None:
    """run.json as qual wrote it: its digest still matches (an edited run.json is refused), and one written with a
    seal keeps it (a qual that sealed run.json also recorded its inputs: one with inputs and no seal was edited).
    Returns a warning for a run.json from before the seal (resumable, its inputs compared as far as recorded)."""
    sealed = data.get("sealed")
    if sealed is None:
        if "inputs" in data:
            raise QualError(f"{where}: its seal (\"sealed\") was removed, so edits cannot be told from the run that "
                            "started: a resumed run must be the run that started; start a new run instead")
        return f"{where} was written by a qual that sealed nothing: edits to it cannot be detected"
    if sealed != _digest({k: v for k, v in data.items() if k != "sealed"}):
        raise QualError(f"{where}: edited since the run started (its digest no longer matches): a resumed run must "
                        "be the run that started; start a new run instead")
    return None


_OFF = (None, False, {}, [])  # the value a key a later qual added has when nobody asked for it
# An option missing from run.json is one the qual that started the run did not have: load_plan gives it its default
# (whatever that is: --axis's is "date"), which is the behaviour from before the option existed
OPTIONS = "options"


def _differences(saved, now, path: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for key in sorted(set(saved) | set(now)):
            if key not in saved and (now[key] in _OFF or path == OPTIONS):
                continue  # an option or field added since the run started, left off: what that run ran
            out += _differences(saved.get(key), now.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if saved == now else [f"{path} {json.dumps(saved)} -> {json.dumps(now)}"]


def check_unchanged(saved: dict | None, now: dict, run_dir) -> None:
    """The inputs recorded when the run started equal the ones a resume would run with (exit 2 naming what changed)."""
    if saved is None:
        return  # a run started by a qual that recorded no inputs
    changed = _differences(saved, now)
    if changed:
        more = f" (and {len(changed) - SHOWN} more)" if len(changed) > SHOWN else ""
        raise QualError(f"--resume {run_dir}: the run's inputs changed since it started: {'; '.join(changed[:SHOWN])}"
                        f"{more}: a resumed run must run what started, so start a new run")
