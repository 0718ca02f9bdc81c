"""`qual schema`: print result.json's JSON Schema, the copy shipped in the package (qual/data/result.schema.json); with
--sweep, a sweep's (qual/data/result.sweep.schema.json); with --profile, a model profile's (qual.profiles); with
--gate, a gate file's (qual.gate_rules: the model qual validates gate files with)."""

from __future__ import annotations

import json
import sys

import typer

from qual.cli.main import app
from qual.errors import QualError
from qual.paths import RESULT_SCHEMA, SWEEP_RESULT_SCHEMA
from qual.userfiles import read_text

MAX_SCHEMA_BYTES = 1 << 22  # the shipped schema: package data, a few hundred KB at most


@app.command("schema")
def schema_command(
    sweep: bool = typer.Option(False, "--sweep", help="A sweep's result.json (qual run --dcp 2,4) instead."),
    profile: bool = typer.Option(False, "--profile", help="A model profile's (configs/models/NAME.yaml) instead: "
                                 "every key, generated from the model qual validates profiles with."),
    gate: bool = typer.Option(False, "--gate", help="A gate file's (configs/gates/NAME.yaml) instead: generated from "
                              "the model qual validates gate files with."),
) -> None:
    """Print the JSON Schema (draft 2020-12) that every result.json this qual writes follows (or a profile's, or a
    gate file's)."""
    if sweep + profile + gate > 1:
        raise QualError("--sweep, --profile and --gate: one schema at a time")
    if profile:
        from qual.profiles import profile_schema

        sys.stdout.write(json.dumps(profile_schema(), indent=1) + "\n")
        return
    if gate:
        from qual.gate_rules import gate_schema

        sys.stdout.write(json.dumps(gate_schema(), indent=1) + "\n")
        return
    sys.stdout.write(read_text(SWEEP_RESULT_SCHEMA if sweep else RESULT_SCHEMA, MAX_SCHEMA_BYTES, "JSON Schema"))
