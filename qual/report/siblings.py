"""The files beside report.html that the page links to, by relative links: the page is opened from file:// and from
CI artifacts, where nothing but the folder's own layout holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

# Named files in the order the page lists them; journals and logs follow, by name.
NAMED = {
    "result.json": "every number of this page, machine-readable",
    "summary.md": "verdict, headline and gate checks as Markdown (a CI step summary)",
    "junit.xml": "one test case per gate check",
    "run.json": "the run's inputs, which qual run --resume checks",
}
PATTERNS = {
    "*.requests.jsonl": "requests journal of the {arm} arm: one finished request a line",
    "*.log": "log of the {arm} arm's engine",
}


@dataclass(frozen=True)
class Sibling:
    name: str
    href: str  # relative to the page's folder, percent-encoded
    what: str


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def siblings(report_dir: Path | None) -> list[Sibling]:
    """The files of NAMED and PATTERNS that exist in report_dir; none without a folder."""
    if report_dir is None or not report_dir.is_dir():
        return []
    out = [Sibling(name, quote(name), what) for name, what in NAMED.items() if _regular(report_dir / name)]
    for pattern, what in PATTERNS.items():
        for path in sorted(report_dir.glob(pattern)):
            if _regular(path):
                arm = path.name.split(".", 1)[0]
                out.append(Sibling(path.name, quote(path.name), what.format(arm=arm)))
    return out
