"""`qual schema`: print result.json's JSON Schema, the copy shipped in the package (qual/data/result.schema.json); with
--sweep, a sweep's (qual/data/result.sweep.schema.json)."""

from __future__ import annotations

import sys

import typer

from qual.cli.main import app
from qual.paths import RESULT_SCHEMA, SWEEP_RESULT_SCHEMA
from qual.userfiles import read_text

MAX_SCHEMA_BYTES = 1 << 22  # the shipped schema: package data, a few hundred KB at most


@app.command("schema")
def schema_command(
    sweep: bool = typer.Option(False, "--sweep", help="A sweep's result.json (qual run --dcp 2,4) instead."),
) -> None:
    """Print the JSON Schema (draft 2020-12) that every result.json this qual writes follows."""
    sys.stdout.write(read_text(SWEEP_RESULT_SCHEMA if sweep else RESULT_SCHEMA, MAX_SCHEMA_BYTES, "JSON Schema"))
