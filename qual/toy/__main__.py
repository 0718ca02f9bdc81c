"""`python -m qual.toy train ...`: the `qual toy` commands without loading the other subcommands."""

from __future__ import annotations

import sys

from qual.cli.toy import toy_app
from qual.errors import QualError

if __name__ == "__main__":
    try:
        toy_app(standalone_mode=False)
    except QualError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
