"""Secrets never reach a file qual writes or a line it prints.

A profile's `vllm.env` passes variables to the server (HF_TOKEN for a gated checkpoint, say). The server
gets the real value; every record of the arm (result.json, run.json, the history, reports, the server
command line in <arm>.arm.json, the log header and `--dry-run`) shows `<redacted>` in its place.

The rule, by name and by value (docs/ARCHITECTURE.md, "Hardening"): a variable whose name looks secret loses its
whole value; any other value, and any URL qual shows, keeps its text with what has a secret's shape replaced: a
URL's userinfo (`postgres://<redacted>@db/x`) and credentials of a known form (bearer tokens, private-key blocks,
Hugging Face, OpenAI-style, GitHub, Slack and AWS keys, JWTs). A secret of neither kind cannot be recognised.

An attached server's URL and API key are checked before use (`check_server_url`, `check_api_key`): a URL holds no
credentials and no control characters, a key only what an HTTP header carries; the key is never shown.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from qual.errors import QualError
from qual.validation import shown

REDACTED = "<redacted>"
# Names that look secret, case-insensitive: HF_TOKEN, OPENAI_API_KEY, MY_PASSWD, MYSQL_PWD, AWS_CREDENTIALS...
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASS|PWD|CREDENTIAL|AUTH|COOKIE", re.IGNORECASE)
# scheme://userinfo@ anywhere in a text: the userinfo goes (user names can be tokens too).
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\s]*@")
# Credentials of a known form, anywhere in a text.
_SECRET_SHAPES = re.compile("|".join([
    r"(?<=Bearer )[^\s\"']+",  # an Authorization header's token
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)",
    r"\bhf_[A-Za-z0-9]{16,}",  # Hugging Face
    r"\bsk-[A-Za-z0-9_\-]{16,}",  # OpenAI-style API keys
    r"\b(?:gh[pousr]_|github_pat_)[A-Za-z0-9_]{16,}",  # GitHub
    r"\bxox[abprs]-[A-Za-z0-9\-]{10,}",  # Slack
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",  # AWS access key ids
    r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*",  # JWTs
]))


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def redact_text(text: str) -> str:
    """text with every secret-shaped part (a URL's userinfo, a credential of a known form) replaced by `<redacted>`."""
    return _SECRET_SHAPES.sub(REDACTED, _USERINFO.sub(rf"\g<1>{REDACTED}@", text))


def redact_url(url: str) -> str:
    """A URL as qual shows and stores it: `http://<redacted>@host/` for `http://user:pass@host/`."""
    return redact_text(url)


def redact_env(env: Mapping) -> dict:
    """env with the value of every secret-looking name replaced by `<redacted>`, and secret shapes in the others."""
    return {k: (REDACTED if is_secret(k) else redact_text(v) if isinstance(v, str) else v) for k, v in env.items()}


def redact_sections(arm: dict) -> dict:
    """An arm's JSON with `extra.<engine>.env` redacted (the one place profiles put environment variables)."""
    extra = arm.get("extra")
    if not isinstance(extra, dict):
        return arm
    sections = {name: ({**section, "env": redact_env(section["env"])}
                       if isinstance(section, dict) and isinstance(section.get("env"), Mapping) else section)
                for name, section in extra.items()}
    return {**arm, "extra": sections}


def check_server_url(flag: str, url: str) -> None:
    """A server's base URL qual can send a key to: http(s), a host, no credentials, no query, nothing a request line
    or header cannot carry. QualError (exit 2) naming the flag; a URL's userinfo is never echoed."""
    bad = next((c for c in url if ord(c) < 0x21 or ord(c) > 0x7E), None)
    if bad is not None:
        what = ("a line break" if bad in "\r\n" else "a space" if bad in " \t" else
                "a control character" if ord(bad) < 0x21 or ord(bad) == 0x7F else "a character beyond ASCII")
        raise QualError(f"{flag} {shown(redact_url(url))}: a URL cannot hold {what} (a request line or header would "
                        "carry it)")
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if parts is None or parts.scheme.lower() not in ("http", "https") or not url.lower().startswith(parts.scheme.lower() + "://"):
        raise QualError(f"{flag} must be an http:// or https:// URL (got {shown(redact_url(url))})")
    try:  # a port of letters or past 65535 is a bad port, said so (urlsplit raises only when .port is read)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if "@" in parts.netloc:
        raise QualError(f"{flag} {redact_url(url)}: credentials in a URL would be shown and stored with it; the "
                        "servers' key goes in an environment variable named by --api-key-env")
    if not parts.hostname or not port_ok:
        raise QualError(f"{flag} {shown(url)}: {'no host' if not parts.hostname else 'not a valid port (1 to 65535)'}")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise QualError(f"{flag} {parts.scheme}://{parts.netloc}{parts.path}?...: a server's base URL takes no query or "
                        "fragment")


def check_api_key(variable: str) -> None:
    """The key in $variable, where set, is one an HTTP header can carry as it is; QualError (exit 2) that never
    shows it. Unset is for the caller: a dry run needs no key."""
    key = os.environ.get(variable)
    if not key:
        return
    at = next((i for i, c in enumerate(key) if not 0x20 <= ord(c) <= 0x7E), None)
    if at is not None:
        c = key[at]
        what = ("a line break" if c in "\r\n" else "a character beyond ASCII" if ord(c) > 0x7E else
                "a control character")
    elif key != key.strip():
        at, what = (0 if key[0] == " " else len(key) - 1), "a leading or trailing space"
    else:
        return
    raise QualError(f"--api-key-env {variable}: the key holds {what} (character {at + 1} of {len(key)}), which an "
                    "HTTP header cannot carry as it is; the key is not shown")
