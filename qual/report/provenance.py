"""Derived views of the engines' facts and each arm's provenance, for the renderers (no I/O, no markup)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from qual.records import HostFacts
from qual.result import ArmResult, Result


@dataclass(frozen=True)
class FactRow:
    label: str
    control: str
    candidate: str
    differs: bool


KNORM = {
    "no": "k_norm CPU bug present: every draft layer's context keys get layer 0's k_norm (acceptance understated)",
    "yes": "none known (each draft layer's context keys get their own k_norm)",
    "unknown": "not observable: whether the build has the k_norm CPU bug (`qual doctor` on its machine tells)",
}
DRAFT_KV = {"yes": "replicated (the build keeps draft KV unsharded under DCP)",
            "no": "sharded: the build shards draft KV with the target (the legacy bug under DCP)",
            "unknown": "not observable from here (`qual doctor` on the server's machine tells)"}
SOURCES = {"per_request_metrics": "per-request metrics", "metrics_diff": "/metrics counter diffs"}


def _engine(arm: ArmResult) -> str:
    p = arm.provenance
    if p is None:
        return arm.engine_version
    e = p.engine
    return " ".join(x for x in (e.name, e.version or "(version unknown)", f"commit {e.commit[:12]}" if e.commit else
                                "(no commit recorded)") if x)


def _host(h: HostFacts | None) -> str:
    if h is None:
        return "not reported"
    device = ", ".join(h.gpus) if h.gpus else f"CPU {h.cpu_model or '(model unknown)'}"
    parts = [device, f"torch {h.torch}" if h.torch else None, f"CUDA {h.cuda}" if h.cuda else None,
             f"driver {h.gpu_driver}" if h.gpu_driver else None, h.hostname, f"({h.source})"]
    return " \u00b7 ".join(x for x in parts if x)


def _acceptance_source(arm: ArmResult) -> str:
    counts: dict[str, int] = {}
    for r in arm.per_request:
        if r.acceptance_source:
            counts[r.acceptance_source] = counts.get(r.acceptance_source, 0) + 1
    said = arm.extra.get("acceptance_source") or ("the engine's own counts" if not counts else "")
    per = ", ".join(f"{SOURCES.get(k, k)}: {n}" for k, n in sorted(counts.items()))
    return f"{said} ({per} requests)" if per and said else said or per


def _command(arm: ArmResult) -> str:
    p = arm.provenance
    command = arm.extra.get("server_command") or (p.engine.server_command if p else None)
    if command:
        return command
    if arm.extra.get("server_url"):
        return f"not visible: a server qual did not start, at {arm.extra['server_url']}"
    if p is not None and p.engine.runtime_config:
        return "runtime config " + json.dumps(p.engine.runtime_config, sort_keys=True, default=str)
    return "not recorded"


def _verified(arm: ArmResult) -> str | None:
    checks = arm.extra.get("verified")
    if not isinstance(checks, dict):
        return None
    return "; ".join(f"{k} {c.get('expected')}: " + (f"verified ({c['source']})" if c.get("reported") is not None else
                                                     "not reported, unverified") for k, c in checks.items())


def _checkpoint(arm: ArmResult, which: str) -> str:
    """A checkpoint's identity, hub revision and path (qual.checkpoints.identity), as provenance recorded them."""
    p = arm.provenance
    if p is None or p.checkpoints is None:
        return "not recorded"
    rec = p.checkpoints.get(which)
    if rec is None:
        return "none"
    revision = f" (revision {rec['revision']})" if rec.get("revision") else ""
    return f"{rec.get('identity')}{revision} · {rec.get('path')}"


def _prov(arm: ArmResult, what) -> str:
    return what(arm.provenance) if arm.provenance is not None else "not recorded"


def engine_facts(result: Result) -> list[FactRow]:
    """What the engines said about themselves and where each number came from, both arms side by side."""
    c, k = result.control, result.candidate

    def row(label: str, fn) -> FactRow:
        a, b = fn(c), fn(k)
        return FactRow(label, a, b, a != b)

    rows = [
        row("engine", _engine),
        row("engine host", lambda a: _host(a.provenance.engine.host) if a.provenance else "not recorded"),
        row("acceptance source", _acceptance_source),
        row("draft-KV replication in the build", lambda a: DRAFT_KV.get(a.extra.get("draft_kv_replicated_in_build"),
                                                                         "n/a (qual's embedded runtime: as configured)")),
        row("known bugs in the build", lambda a: KNORM.get(a.extra.get("dflash_context_knorm_per_layer_in_build"),
                                                           "none known")),
        row("server command or runtime config", _command),
    ]
    if any(_verified(a) for a in (c, k)):
        rows.append(row("declared configuration", lambda a: _verified(a) or "n/a"))
    rows += [
        row("log", lambda a: a.log_path or "none"),
        row("qual", lambda a: _prov(a, lambda p: f"{p.qual_version} "
                                   + (f"git {p.qual_commit[:12]}{' (modified)' if p.qual_checkout_dirty else ''}"
                                      if p.qual_commit else "(installed, no checkout)"))),
        row("qual host", lambda a: _prov(a, lambda p: _host(p.host))),
        row("target checkpoint", lambda a: _checkpoint(a, "target")),
        row("draft checkpoint", lambda a: _checkpoint(a, "draft")),
        row("corpus fingerprint", lambda a: _prov(a, lambda p: p.corpus_fingerprint)),
        row("gate file", lambda a: _prov(a, lambda p: p.gate_sha256 or "inline rules")),
    ]
    if any(a.provenance is not None and a.provenance.chat_template for a in (c, k)):
        rows.append(row("chat template", lambda a: _prov(a, _chat_template)))
    return rows


def _chat_template(p) -> str:
    t = p.chat_template
    if not t:
        return "none (no chat rows)"
    return f"{t['sha256']} · {t['source']}" + (f" (named {t['name']})" if t.get("name") else "")


def log_href(arm: ArmResult, report_dir: Path | None) -> str | None:
    """A link to the arm's log relative to the report's folder (absolute where it lies elsewhere)."""
    if not arm.log_path:
        return None
    log = Path(arm.log_path)
    if report_dir is None:
        return log.as_posix()
    try:
        return Path(os.path.relpath(log.resolve(), Path(report_dir).resolve())).as_posix()
    except ValueError:  # another drive (Windows)
        return log.as_posix()
