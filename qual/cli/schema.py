"""`qual schema`: print result.json's JSON Schema, the copy shipped in the package (qual/data/result.schema.json); with
--sweep, a sweep's (qual/data/result.sweep.schema.json)."""

from __future__ import annotations

import sys

import typer

from qual.cli.main import app
from qual.paths import RESULT_SCHEMA, SWEEP_RESULT_SCHEMA


@app.command("schema")
def schema_command(
    sweep: bool = typer.Option(False, "--sweep", help="A sweep's result.json (qual run --dcp 2,4) instead."),
) -> None:
    """Print the JSON Schema (draft 2020-12) that every result.json this qual writes follows."""
    sys.stdout.write((SWEEP_RESULT_SCHEMA if sweep else RESULT_SCHEMA).read_text(encoding="utf-8"))
