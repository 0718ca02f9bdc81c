"""Every file the docs, comments and docstrings point at exists in the repo.

A reference is a path under one of the repo's top folders with a file extension (`bench/run_wall.py`,
`docs/vllm.md`), read from README.md and docs/**/*.md whole, and from the comments and docstrings of qual/**/*.py
and bench/*.py; it resolves against the repo root. Folders, globs (`tests/test_*.py`) and paths inside other
projects (`vllm/tests/...`) are not references.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"(?<![\w./-])(bench|tests|docs|qual|patches|configs|corpora)/[A-Za-z0-9_./-]+"
                       r"\.(py|md|json|jsonl|yaml|yml|patch|sh)\b")


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in a module's source."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.extend((first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines()))
    return out


def prose() -> list[tuple[Path, int, str]]:
    """(file, line, text) of every place a reference may be written."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "configs").rglob("*.md")),
            *sorted((REPO / "corpora").rglob("*.md"))]
    out = [(path, n, line) for path in docs for n, line in enumerate(path.read_text().splitlines(), 1)]
    for path in [*sorted((REPO / "qual").rglob("*.py")), *sorted((REPO / "bench").glob("*.py"))]:
        out.extend((path, n, text) for n, text in python_prose(path.read_text()))
    for path in sorted((REPO / "configs").rglob("*.yaml")):  # the profiles' and gates' comments
        out.extend((path, n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if "#" in line)
    return out


def missing_references() -> list[str]:
    return [f"{path.relative_to(REPO)}:{n}: {m.group(0)}" for path, n, text in prose()
            for m in REFERENCE.finditer(text) if not (REPO / m.group(0)).exists()]


def test_every_referenced_path_exists():
    assert missing_references() == []


def test_the_search_finds_references():
    """The detector is live: it reads docstrings and comments, and skips globs and other projects' paths."""
    found = python_prose('"""See docs/vllm.md."""\nx = 1  # bench/gone.py\ndef f():\n    """tests/gone.py"""\n'
                         '# configs/gates/gone.yaml, corpora/gone.jsonl\n')
    assert [(n, m.group(0)) for n, t in found for m in REFERENCE.finditer(t)] == [
        (2, "bench/gone.py"), (5, "configs/gates/gone.yaml"), (5, "corpora/gone.jsonl"), (1, "docs/vllm.md"),
        (4, "tests/gone.py")]
    assert not REFERENCE.search("tests/test_*.py, vllm/tests/x.py, docs/**/*.md")
    assert any("README.md" == p.name for p, _, _ in prose())
