"""The signals that end a qual command with exit 130: Ctrl-C, a CI job's stop, a closed terminal.

A module of its own that imports nothing but `signal`: the console entry (qual/cli/entry.py) installs its handlers
for these before importing anything else. Rank processes and server guards ignore them: the driver stops its
children itself.
"""

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# The first stop signal the command received, set by its handler (qual/cli/main.py). The handler raises
# KeyboardInterrupt wherever the main thread is, and inside a C extension that can come back as the extension's own
# error: safetensors' load_file, interrupted while it makes a tensor, raises ValueError("could not determine the
# shape of object type 'torch.storage.UntypedStorage'"). Code that turns errors into one-line failures asks here
# first, so that a signal still ends the command with exit 130, not as an unreadable checkpoint.
received: int | None = None


def check_stopping() -> None:
    """Raise KeyboardInterrupt if a stop signal has arrived: the error being handled may be its disguise."""
    if received is not None:
        raise KeyboardInterrupt
