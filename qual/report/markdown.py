"""summary.md: verdict, headline numbers and gate checks for a CI step summary (GitHub-flavoured Markdown)."""

from __future__ import annotations

import re
from pathlib import Path

from qual.report import common, provenance
from qual.result import Result


def cell(text: object) -> str:
    """Make untrusted text inert inside a Markdown table cell (GitHub renders inline HTML)."""
    s = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = s.replace("|", "\\|").replace("`", "\\`")
    return re.sub(r"[\r\n]+", " ", s)


def _fence(text: str) -> str:
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def render(result: Result) -> str:
    """The summary as Markdown text."""
    passed = result.gate.passed
    n_pass = sum(c.passed for c in result.gate.checks)
    c_dcp, k_dcp = result.control.config.get("dcp"), result.candidate.config.get("dcp")
    lines = [
        f"## {'✅ PASS' if passed else '❌ FAIL'}: qual {cell(common.title(result))}",
        "",
        f"{n_pass}/{len(result.gate.checks)} gate checks passed on {result.corpus.count} requests "
        f"of `{cell(result.corpus.name)}`.",
        "",
        f"| | control (DCP {cell(c_dcp)}) | candidate (DCP {cell(k_dcp)}) | candidate − control |",
        "|---|---:|---:|---|",
    ]
    lines += [f"| {cell(h.label)} | {cell(h.control)} | {cell(h.candidate)} | {cell(h.delta)} |" for h in common.headline(result)]
    lines += ["", "### Gate checks", "", "| | check | detail |", "|---|---|---|"]
    for c in result.gate.checks:
        lines.append(f"| {'⏭️' if c.skipped else '✅' if c.passed else '❌'} | {cell(c.name)} | {cell(c.detail)} |")
    cats = [r for r in result.comparison.per_category if r.get("delta") is not None]
    if len(cats) > 1:
        cats.sort(key=lambda r: (r["delta"], r["category"]))
        lines += ["", "### Per category (worst first)", "", "| category | requests | control | candidate | Δ |", "|---|---:|---:|---:|---:|"]
        lines += [
            f"| {cell(r['category'])} | {r['n']} | {common.pct(r['control_rate'])} | "
            f"{common.pct(r['candidate_rate'])} | {common.pp(r['delta'])} |"
            for r in cats[:10]
        ]
    if result.warnings:
        lines += ["", "### ⚠️ The arms' provenance differs", ""] + [f"- {cell(w)}" for w in result.warnings]
    lines += ["", "### Engines and provenance", "", "| | control | candidate |", "|---|---|---|"]
    lines += [f"| {cell(f.label)} | {cell(f.control)} | {cell(f.candidate)} |" for f in provenance.engine_facts(result)]
    lines += ["", f"Corpus fingerprint: `{cell(result.corpus.fingerprint)}`", ""]
    if result.reproduce:
        fence = _fence(result.reproduce)
        lines += ["Reproduce:", "", f"{fence}sh", result.reproduce, fence, ""]
    return "\n".join(lines)


def write(result: Result, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render(result), encoding="utf-8")
    return path
