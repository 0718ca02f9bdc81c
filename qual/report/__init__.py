"""Renderers of one Result (or a sweep's SweepResult): result.json, report.html, summary.md, junit.xml."""

from __future__ import annotations

from pathlib import Path

from qual.result import Result
from qual.sweep_result import SweepResult

FILES = {"json": "result.json", "html": "report.html", "markdown": "summary.md", "junit": "junit.xml"}


def write_reports(result: Result | SweepResult, out_dir: str | Path,
                  history: str | Path | None = None) -> dict[str, Path]:
    """Write all four reports into out_dir; returns {kind: path}. history: the database the run is recorded in (its
    reports name it in the command that pins the night), None where it is not recorded."""
    from qual.report import html, json, junit, markdown

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writers = {"json": json.write, "html": lambda r, p: html.write(r, p, history),
               "markdown": lambda r, p: markdown.write(r, p, history), "junit": junit.write}
    # report.html last: it links to the files beside it that exist when it is written.
    written = {kind: writers[kind](result, out / FILES[kind]) for kind in sorted(FILES, key=lambda k: k == "html")}
    return {kind: written[kind] for kind in FILES}
