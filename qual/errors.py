"""The two error types the CLI turns into exit codes."""

from __future__ import annotations

from pathlib import Path


class QualError(Exception):
    """A user, configuration or input mistake: one line on stderr, exit 2."""


class EngineError(Exception):
    """The engine failed (start, crash, hang): exit 3, with the cause and log path."""

    def __init__(self, message: str, log_path: str | Path | None = None):
        super().__init__(message)
        self.log_path = str(log_path) if log_path else None

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base} (log: {self.log_path})" if self.log_path else base


class InternalError(Exception):
    """A bug in qual (an exception that is none of the above): exit 4, one line, the traceback saved to a file."""
