"""Secret values in a profile's environment entries never reach a file qual writes.

A profile's `vllm.env` passes variables to the server (HF_TOKEN for a gated checkpoint, say). The server
gets the real value; every record of the arm (result.json, run.json, the history, reports, the server
command line in <arm>.arm.json and the log header) shows `<redacted>` in its place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

REDACTED = "<redacted>"
# Names that look secret, case-insensitive: *KEY*, *TOKEN*, *SECRET*, *PASSWORD* (HF_TOKEN, OPENAI_API_KEY...).
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def redact_env(env: Mapping) -> dict:
    """env with the value of every secret-looking name replaced by `<redacted>`."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in env.items()}


def redact_sections(arm: dict) -> dict:
    """An arm's JSON with `extra.<engine>.env` redacted (the one place profiles put environment variables)."""
    extra = arm.get("extra")
    if not isinstance(extra, dict):
        return arm
    sections = {name: ({**section, "env": redact_env(section["env"])}
                       if isinstance(section, dict) and isinstance(section.get("env"), Mapping) else section)
                for name, section in extra.items()}
    return {**arm, "extra": sections}
