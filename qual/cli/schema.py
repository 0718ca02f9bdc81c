"""`qual schema`: print result.json's JSON Schema, the copy shipped in the package (qual/data/result.schema.json)."""

from __future__ import annotations

import sys

from qual.cli.main import app
from qual.paths import RESULT_SCHEMA


@app.command("schema")
def schema_command() -> None:
    """Print the JSON Schema (draft 2020-12) that every result.json this qual writes follows."""
    sys.stdout.write(RESULT_SCHEMA.read_text(encoding="utf-8"))
