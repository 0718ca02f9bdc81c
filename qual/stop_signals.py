"""The signals that end a qual command with exit 130: Ctrl-C, a CI job's stop, a closed terminal.

A module of its own that imports nothing but `signal`: the console entry (qual/cli/entry.py) installs its handlers
for these before importing anything else. Rank processes and server guards ignore them: the driver stops its
children itself.
"""

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
