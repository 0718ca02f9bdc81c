"""Renderers of one Result: result.json, report.html, summary.md, junit.xml."""

from __future__ import annotations

from pathlib import Path

from qual.result import Result

FILES = {"json": "result.json", "html": "report.html", "markdown": "summary.md", "junit": "junit.xml"}


def write_reports(result: Result, out_dir: str | Path) -> dict[str, Path]:
    """Write all four reports into out_dir; returns {kind: path}."""
    from qual.report import html, json, junit, markdown

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writers = {"json": json.write, "html": html.write, "markdown": markdown.write, "junit": junit.write}
    return {kind: writers[kind](result, out / name) for kind, name in FILES.items()}
