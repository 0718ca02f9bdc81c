"""Text qual shows people: a command for copying is shell-quoted, and text that came from a file, a history, a server
or a file name has its control characters escaped before it reaches a terminal or a Markdown page.

A control character printed raw is an instruction to the terminal (ESC [ ... moves the cursor, rewrites the
title, hides the rest of a line), a line break splits a one-line error in two, and a bidirectional override
(U+202E) shows text in another order than it runs. Escaped, each reads as its code: `\\x1b`, `\\n`, `\\u202e`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

# C0 controls (line breaks and tabs included), DEL, C1 controls, and the Unicode bidirectional controls.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escaped(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def has_control(text: str) -> bool:
    """Whether text holds a character safe() would write as its escape (what a label qual records may not hold)."""
    return _CONTROL.search(text) is not None


def safe(text: object) -> str:
    """str(text) with every control character written as its escape: one line, nothing a terminal acts on."""
    s = str(text)
    return _CONTROL.sub(_escaped, s) if _CONTROL.search(s) else s


def multiline(text: object) -> str:
    """str(text) with every control character but line breaks and tabs written as its escape: text a page shows in
    its own lines (report.html, the published site), nothing a terminal or an XML parser acts on."""
    s = str(text)
    return _CONTROL.sub(lambda m: m.group() if m.group() in "\t\n\r" else _escaped(m), s) if _CONTROL.search(s) else s


def command(argv: Iterable[object]) -> str:
    """A command line to copy into a POSIX shell: every argument quoted where it must be (a path with a space,
    `;`, `>`, `$(...)` stays one argument and runs nothing), control characters escaped afterwards."""
    return safe(shlex.join(str(a) for a in argv))
