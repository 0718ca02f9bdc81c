"""pyproject.toml's dependencies against qual's own imports (ast): every package qual/ imports is a core dependency
(one that comes only with another, as markupsafe with jinja2, is declared all the same: qual relies on it by name),
unless the import is optional (inside `try: ... except ImportError`) or a developer's extra's in the code that
extra serves; and every core dependency is imported for something."""

from __future__ import annotations

import ast
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


CORE = _names(PROJECT["dependencies"])
EXTRAS = {extra: _names(reqs) for extra, reqs in PROJECT["optional-dependencies"].items()}
# A dev extra's package -> the one folder of qual/ that imports it: `qual toy train` (Makefile's toy targets) builds
# the shipped toy pairs with transformers' models; nothing a run does imports it.
DEV_ONLY = {"transformers": "qual/toy/"}


def _optional(tree: ast.AST) -> set[int]:
    """ids of the import statements inside a try whose handlers catch ImportError: qual runs without them."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def _imported(optional: bool = False) -> dict[str, set[str]]:
    """Top-level module -> the qual files that import it (every import statement: function-local ones too; those
    inside `except ImportError` only with `optional`), beyond the standard library and qual itself."""
    out: dict[str, set[str]] = {}
    for path in (ROOT / "qual").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        skipped = set() if optional else _optional(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            else:
                continue
            for top in {m.partition(".")[0] for m in modules} - set(sys.stdlib_module_names) - {"qual", "__future__"}:
                out.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return out


@cache
def _providers() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    """The distributions installed here that provide a top-level module; its own name where none does."""
    found = _providers().get(module)
    return {canonicalize_name(d) for d in found} if found else {canonicalize_name(module)}


def test_every_package_qual_imports_is_declared():
    undeclared = {module: sorted(files) for module, files in _imported().items()
                  if not _distributions(module) & CORE
                  and not (module in DEV_ONLY and all(f.startswith(DEV_ONLY[module]) for f in files))}
    assert not undeclared, f"imported by qual/ but not in pyproject.toml's dependencies: {undeclared}"


def test_the_dev_only_packages_are_the_dev_extras():
    assert {canonicalize_name(m) for m in DEV_ONLY} <= EXTRAS["dev"]


def test_every_core_dependency_is_imported_by_qual():
    imported = set().union(*(_distributions(m) for m in _imported(optional=True)))
    assert CORE - imported == set(), "declared in pyproject.toml but imported nowhere in qual/"
