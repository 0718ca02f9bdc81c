"""The outcome words are spelled once (qual/outcomes.py): no other module of qual/ binds a module-level name to one
of them, as gate.py, result.py and history/runs.py each once did."""

from __future__ import annotations

import ast
from pathlib import Path

from qual import outcomes

QUAL = Path(__file__).resolve().parents[1] / "qual"
WORDS = {outcomes.PASS, outcomes.FAIL, outcomes.INCONCLUSIVE, outcomes.SKIPPED, outcomes.ERROR}


def spelled(source: str) -> list[int]:
    """Lines of module-level assignments whose value is outcome words as literals (one, or a tuple of them)."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            values = node.value.elts if isinstance(node.value, (ast.Tuple, ast.List)) else [node.value]
            words = [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            if words and set(words) <= WORDS:  # outcome words alone (a table of columns may name an `error` column)
                found.append(node.lineno)
    return found


def test_only_qual_outcomes_spells_the_outcome_words():
    bad = [f"qual/{p.relative_to(QUAL)}:{line}" for p in sorted(QUAL.rglob("*.py")) if p.name != "outcomes.py" or
           p.parent != QUAL for line in spelled(p.read_text())]
    assert bad == []


def test_the_guard_finds_a_second_spelling():
    planted = 'PASS, FAIL = "pass", "fail"\nX = "other"\nCHECK_SKIPPED: str = "skipped"\nCOLUMNS = ("id", "error")\n'
    assert spelled(planted) == [1, 3]
    assert spelled((QUAL / "outcomes.py").read_text()) != []
