"""The run options' vocabulary has one home, qual/options.py: no list of an option's values and no default of one is
spelled anywhere else in the package (found by reading every module's syntax tree)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qual import options
from qual.errors import QualError

QUAL = Path(__file__).resolve().parents[1] / "qual"
VOCABULARIES = {"dtype": options.DTYPES, "draft_kv": options.DRAFT_KV_MODES, "dsa_topk": options.DSA_TOPK_MODES,
                "dcp_comm": options.DCP_COMM_MODES, "numerics": options.NUMERICS}
VALUES = {v: name for name, values in VOCABULARIES.items() for v in values}
# Other facts that happen to be spelled in the same words, each with why it is not an option's vocabulary.
ELSEWHERE = {
    ("checkpoints/weights.py", "dtype"): "the casts a stored weight dtype may take without being asked (IMPLIED_CASTS)",
    ("runtime/backends/__init__.py", "dtype"): "the dtypes the Triton kernels compile for",
    ("engines/vllm/engine.py", "numerics"): "the engine's name, vllm",
    ("engines/vllm/doctor.py", "numerics"): "the vLLM distribution's name",
}


def _strings(nodes) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _defaults(tree: ast.AST):
    """(node, value) of every default spelled as a string constant: function parameters, class-level fields,
    Field(...) / typer.Option(...) defaults, and `x or "value"`."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
                yield d
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.AnnAssign, ast.Assign)) and stmt.value is not None:
                    yield stmt.value
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("Field", "Option"):
            yield from node.args[:1]
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            yield from node.values[1:]


def findings() -> list[str]:
    out = []
    for path in sorted(QUAL.rglob("*.py")):
        rel = str(path.relative_to(QUAL))
        if rel == "options.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            items = None
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                items = _strings(node.elts)
            elif isinstance(node, ast.Dict):
                items = _strings([k for k in node.keys if k is not None])
            if items:
                for name, values in VOCABULARIES.items():
                    hit = [v for v in items if v in values]
                    if len(hit) >= 2 and (rel, name) not in ELSEWHERE:
                        out.append(f"qual/{rel}:{node.lineno}: the {name} values {hit} (a list: qual/options.py has it)")
        for d in _defaults(tree):
            if isinstance(d, ast.Constant) and d.value in VALUES and (rel, VALUES[d.value]) not in ELSEWHERE:
                out.append(f"qual/{rel}:{d.lineno}: default {d.value!r} of {VALUES[d.value]} (qual/options.py has it)")
    return out


def test_no_option_values_or_defaults_outside_qual_options():
    assert findings() == []


def test_the_search_finds_what_it_looks_for(tmp_path, monkeypatch):
    """The check itself: a planted list and a planted default are found (the test above cannot pass vacuously)."""
    (tmp_path / "planted.py").write_text('MODES = ("exact", "union")\n\n\ndef f(kv="sharded"):\n    return kv or "a2a"\n')
    monkeypatch.setattr(__import__(__name__), "QUAL", tmp_path)
    assert len(findings()) == 3


def test_checks_name_the_option():
    with pytest.raises(QualError, match="draft_kv must be one of replicated, sharded"):
        options.check_choice("draft_kv", "both", options.DRAFT_KV_MODES)
    with pytest.raises(QualError, match="tp % dcp == 0"):
        options.check_layout(4, 3)
    for bad in ("gpu", "cuda:x", "cuda:"):
        with pytest.raises(QualError, match="device must be cpu, cuda or cuda:N"):
            options.check_device("device", bad)
    for bad in (float("nan"), -0.5, float("inf"), True):
        with pytest.raises(QualError, match="finite number >= 0"):
            options.check_temperature("temperature", bad)
