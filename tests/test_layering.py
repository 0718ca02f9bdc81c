"""The package's layering, read from its own imports (ast): one direction through the seams, no cycles."""

from __future__ import annotations

import ast
from pathlib import Path

QUAL = Path(__file__).resolve().parents[1] / "qual"
# Layers that reach engines only through qual.engines.registry and know nothing of the runtime.
ABOVE_THE_SEAM = ("qual.harness", "qual.cli", "qual.report", "qual.gate", "qual.stats", "qual.result", "qual.history",
                  "qual.records", "qual.profiles", "qual.corpus")
NEUTRAL = ("qual.records", "qual.errors", "qual.options", "qual.validation", "qual.userfiles", "qual.paths",
           "qual.checkpoints", "qual.files", "qual.redact", "qual.proc", "qual.stop_signals", "qual.shown")


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(QUAL.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in QUAL.rglob("*.py")}


def _imports(mod: str, path: Path, known: set[str]) -> set[str]:
    """The qual modules `mod` imports (every import statement, TYPE_CHECKING and function-local ones too)."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known and n != mod}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_the_layers_above_the_engine_seam_import_no_engine_internals_nor_the_runtime():
    bad = [f"{m} -> {o}" for m, outs in _graph().items() if _under(m, ABOVE_THE_SEAM)
           for o in outs if _under(o, ("qual.runtime", "qual.engines.vllm", "qual.engines.reference"))]
    assert bad == []


def test_the_runtime_imports_nothing_above_it():
    allowed = ("qual.runtime", *NEUTRAL)
    bad = [f"{m} -> {o}" for m, outs in _graph().items() if _under(m, ("qual.runtime",)) for o in outs if not _under(o, allowed)]
    assert bad == []


def test_neutral_modules_import_only_neutral_ones():
    bad = [f"{m} -> {o}" for m, outs in _graph().items() if _under(m, NEUTRAL) for o in outs if not _under(o, NEUTRAL)]
    assert bad == []


def test_no_import_cycles():
    """Among modules (a package's __init__ re-exports its own modules: not a cycle of layers)."""
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    graph = {m: outs - packages for m, outs in _graph().items() if m not in packages}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                comp.append(w)
            on_stack.discard(v)
            if comp:
                cycles.append(sorted([v, *comp]))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_checker_sees_a_violation():
    """The graph really is read from the source: the harness's plan imports the engine registry."""
    assert "qual.engines.registry" in _graph()["qual.harness.plan"]


def test_every_torch_load_refuses_pickled_code():
    """torch.load unpickles: without weights_only=True a crafted file runs code (checked from the source)."""
    calls = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                calls.append((f"{mod}:{node.lineno}", safe))
    assert calls, "qual calls torch.load somewhere (the toy pipeline's generated data)"
    assert [where for where, safe in calls if not safe] == []


def test_no_runtime_module_is_longer_than_350_lines():
    """Small modules with one job (nano-vllm keeps every file under ~260 lines)."""
    long = {str(p.relative_to(QUAL)): n for p in (QUAL / "runtime").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 350}
    assert long == {}
