"""What each night records beside its configuration key: the software and machine under test, and the user's labels.

A series (qual.configuration) holds the nights of one experiment; these facts are what may change between its
nights, and the axis a series is plotted along (`qual history trend --axis engine|qual|meta:KEY`): the engine's
version and commit, qual's version and commit, torch, CUDA, the GPU driver and model, the host, and each
`qual run --meta KEY=VALUE`. `changes` names what differs between two nights' software and machine in one line:
`engine vllm 0.32.0 -> 0.33.0.dev41+g1a2b3c4; torch 2.13.0 -> 2.14.0`.
"""

from __future__ import annotations

import re
from typing import Any

from qual.errors import QualError
from qual.shown import has_control

# The facts, in the order `changes` names them.
FACTS = ("engine", "engine_commit", "torch", "cuda", "driver", "gpu", "host", "qual")
AXES = ("date", "engine", "qual")  # and meta:KEY
META_PREFIX = "meta:"
_META_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
MAX_META_VALUE = 500  # characters: a URL, a commit, a cluster name


def facts_of(result) -> dict[str, str | None]:
    """One night's facts from its result (a qual.result.Result): the candidate arm's engine and the machine it ran on
    (as the engine reports it), and qual's version and commit."""
    arm = result.candidate
    p = arm.provenance
    out: dict[str, str | None] = {name: None for name in FACTS}
    out["engine"] = arm.engine_version or None
    if p is None:
        return out
    out.update(engine_commit=p.engine.commit, qual=qual_label(p.qual_version, p.qual_commit, p.qual_checkout_dirty))
    host = p.engine.host  # None: an attached server that said nothing of its machine (qual's own says nothing of it)
    if host is not None:
        out.update(torch=host.torch, cuda=host.cuda, driver=host.gpu_driver, host=host.hostname,
                   gpu=", ".join(sorted(set(host.gpus))) if host.gpus else "CPU")
    return out


def qual_label(version: str | None, commit: str | None, dirty: bool | None = None) -> str | None:
    """'0.1.0 1a2b3c4d5e6f' (12 digits of the commit, '+modified' for a checkout that differed from it)."""
    if version is None and commit is None:
        return None
    text = " ".join(x for x in (version, commit[:12] if commit else None) if x)
    return text + ("+modified" if dirty else "")


def parse_meta(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--meta KEY=VALUE` (repeatable) as a mapping; a malformed pair or a key given twice is exit 2 naming it."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _META_KEY.fullmatch(key):
            raise QualError(f"--meta {_shown(pair)}: expected KEY=VALUE, KEY letters, digits, '_', '.' or '-' (at most "
                            "64, not starting with a digit)")
        if key in out:
            raise QualError(f"--meta {key}: given twice")
        if len(value) > MAX_META_VALUE or has_control(value):  # C1 and bidirectional controls too: qual.shown's set
            raise QualError(f"--meta {key}: the value must be at most {MAX_META_VALUE} characters without control "
                            "characters")
        out[key] = value
    return out


def is_axis(axis: str) -> bool:
    """date, engine, qual or meta:KEY (KEY as --meta spells it)."""
    return axis in AXES or (axis.startswith(META_PREFIX) and bool(_META_KEY.fullmatch(axis[len(META_PREFIX):])))


def axis_choices() -> str:
    """'date, engine, qual or meta:KEY': what --axis takes, for its messages."""
    return f"{', '.join(AXES)} or {META_PREFIX}KEY"


def check_axis(axis: str) -> str:
    """date | engine | qual | meta:KEY, else exit 2 naming them."""
    if is_axis(axis):
        return axis
    raise QualError(f"--axis {_shown(axis)}: expected one of {axis_choices()}")


def axis_value(axis: str, created_at: str, facts: dict[str, Any], meta: dict[str, str]) -> str | None:
    """One night's place on the axis: its date (UTC), a fact, or a --meta value (None: the night did not record it)."""
    if axis == "date":
        return created_at
    if axis.startswith(META_PREFIX):
        return meta.get(axis[len(META_PREFIX):])
    return facts.get(axis)


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two nights' software and machine, one phrase each: 'engine vllm 0.32.0 -> 0.33.0',
    'torch 2.13.0 -> 2.14.0'. A fact one night did not record is no change. (--meta labels are the user's: a CI run's
    URL differs every night; they are shown with each night, not named as changes.)"""
    out = []
    for name in FACTS:
        a, b = before.get(name), after.get(name)
        if a is not None and b is not None and a != b:
            out.append(_phrase(name, str(a), str(b)))
    return out


def _phrase(name: str, a: str, b: str) -> str:
    """'engine vllm 0.32.0 -> 0.33.0': a first word both share (the engine's name) is said once."""
    head_a, _, rest_a = a.partition(" ")
    head_b, _, rest_b = b.partition(" ")
    if head_a == head_b and rest_a and rest_b:
        return f"{name} {head_a} {rest_a} -> {rest_b}"
    return f"{name} {a} -> {b}"


def _shown(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:57] + "...")
