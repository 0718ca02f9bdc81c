"""`qual schema`: print result.json's JSON Schema, the copy shipped in the package (qual/data/result.schema.json); with
--sweep, a sweep's (qual/data/result.sweep.schema.json); with --gate, a gate file's (from the model qual validates gate
files with, qual.gate_rules)."""

from __future__ import annotations

import sys

import typer

from qual.cli.main import app
from qual.errors import QualError
from qual.paths import RESULT_SCHEMA, SWEEP_RESULT_SCHEMA


@app.command("schema")
def schema_command(
    sweep: bool = typer.Option(False, "--sweep", help="A sweep's result.json (qual run --dcp 2,4) instead."),
    gate: bool = typer.Option(False, "--gate", help="A gate file's (configs/gates/*.yaml) instead: the model qual "
                              "validates gate files with."),
) -> None:
    """Print the JSON Schema (draft 2020-12) that every result.json this qual writes follows (or a gate file)."""
    if sweep and gate:
        raise QualError("--sweep and --gate: give one (a sweep's result.json, or a gate file)")
    if gate:
        import json

        from qual.gate_rules import gate_schema

        sys.stdout.write(json.dumps(gate_schema(), indent=1) + "\n")
        return
    sys.stdout.write((SWEEP_RESULT_SCHEMA if sweep else RESULT_SCHEMA).read_text(encoding="utf-8"))
