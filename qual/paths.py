"""Where qual's shipped data lives (package data, so a wheel install works) and where outputs go by default."""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

# configs/models/*.yaml (profiles), configs/gates/*.yaml, corpora/*.jsonl, models/toy/: inside the package.
DATA_DIR = Path(str(files("qual") / "data"))
PROFILE_DIR = DATA_DIR / "configs" / "models"
GATE_DIR = DATA_DIR / "configs" / "gates"
DEFAULT_GATE = GATE_DIR / "nightly.yaml"
# Outputs go under the working directory, never into the package.
REPORTS_DIR = Path("reports")
DEFAULT_HISTORY = REPORTS_DIR / "history.sqlite"


def corpora_dir() -> Path:
    """Named corpora: $QUAL_ROOT/corpora when set (tests, private corpora), else the shipped ones."""
    root = os.environ.get("QUAL_ROOT")
    return Path(root) / "corpora" if root else DATA_DIR / "corpora"


def source_checkout() -> Path | None:
    """The git checkout qual is imported from (an editable install), or None for an installed wheel."""
    top = Path(__file__).resolve().parents[1]
    return top if (top / "pyproject.toml").is_file() and (top / "qual").is_dir() else None


def cache_dir() -> Path:
    """What qual keeps between runs that it can always recompute (answers about installs): $XDG_CACHE_HOME/qual,
    else ~/.cache/qual."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qual"
