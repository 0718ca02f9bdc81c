"""`qual schema`: print result.json's JSON Schema, the copy shipped in the package (qual/data/result.schema.json); with
--sweep, a sweep's (qual/data/result.sweep.schema.json); with --profile, a model profile's (qual.profiles); with
--gate, a gate file's (qual.gate_rules: the model qual validates gate files with); with --doctor, `qual doctor --json`'s
(qual.cli.doctor: generated from its checks' record)."""

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
    doctor: bool = typer.Option(False, "--doctor", help="`qual doctor --json`'s instead (a list of checks): generated "
                                "from the record doctor prints."),
) -> None:
    """Print the JSON Schema (draft 2020-12) that every result.json this qual writes follows (or a profile's, a gate
    file's, or `qual doctor --json`'s)."""
    if sweep + profile + gate + doctor > 1:
        raise QualError("--sweep, --profile, --gate and --doctor: one schema at a time")
    if profile:
        from qual.profiles import profile_schema

        sys.stdout.write(json.dumps(profile_schema(), indent=1) + "\n")
        return
    if gate:
        from qual.gate_rules import gate_schema

        sys.stdout.write(json.dumps(gate_schema(), indent=1) + "\n")
        return
    if doctor:
        from qual.cli.doctor import doctor_schema

        sys.stdout.write(json.dumps(doctor_schema(), indent=1) + "\n")
        return
    sys.stdout.write(read_text(SWEEP_RESULT_SCHEMA if sweep else RESULT_SCHEMA, MAX_SCHEMA_BYTES, "JSON Schema"))
