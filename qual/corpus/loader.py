"""Find corpora by name or path and load them (validated, then through `datasets`)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from qual import paths
from qual.errors import QualError
from qual.validation import shown

from .records import Corpus, CorpusRequest, Message, fingerprint
from .validate import parse_jsonl

if TYPE_CHECKING:  # datasets costs ~1.5 s to import: only paid when a corpus is loaded
    import datasets

SUFFIX = paths.KINDS["corpus"][1]  # ".jsonl"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_NAME = 128  # <name>.manifest.json, and a temporary name beside it, within a file name's 255 bytes


def corpus_places(root: str | Path | None = None) -> list[paths.Place]:
    """Where named corpora are looked for: <root>/corpora when given, else qual.paths' search order ($QUAL_ROOT,
    the checkout's corpora/, the package's copy)."""
    if root is not None:
        return [paths.Place(Path(root) / "corpora", "given")]
    return paths.places("corpus")


def named_corpora(root: str | Path | None = None) -> dict[str, paths.Found]:
    """Every named corpus, sorted by name, each where the search finds it first."""
    return paths.available("corpus", corpus_places(root))


def available_corpora(root: str | Path | None = None) -> list[str]:
    """Names of the named corpora (sorted)."""
    return list(named_corpora(root))


def searched(root: str | Path | None = None) -> str:
    """The folders searched, for messages."""
    return ", ".join(p.describe() for p in corpus_places(root)) or "no corpora folder"


def import_folder(root: str | Path | None = None) -> Path:
    """Where `qual corpus import` writes by default: the first writable folder of the search ($QUAL_ROOT/corpora,
    created if need be; the checkout's corpora/), never an installed package's copy."""
    for place in corpus_places(root):
        if place.origin == "package":
            continue
        existing = next(p for p in (place.folder, *place.folder.parents) if p.exists())
        if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
            return place.folder
    raise QualError("no writable corpora folder: pass --into DIR, or set QUAL_ROOT to a folder whose corpora/ "
                    "qual should search and write (an installed package is never written)")


def is_path_like(name_or_path: str) -> bool:
    """A bare name has no separator and no .jsonl suffix; anything else is a path."""
    return (
        "/" in name_or_path
        or os.sep in name_or_path
        or name_or_path.endswith(SUFFIX)
        or name_or_path.startswith(".")
    )


def check_name(name: str) -> str:
    """Corpus names become file names: letters, digits, '.', '_', '-'."""
    if not NAME_RE.match(name) or name.endswith(SUFFIX):
        raise QualError(
            f"invalid corpus name {shown(name)}: use letters, digits, '.', '_' or '-' (no path, no {SUFFIX})"
        )
    if len(name) > MAX_NAME:
        raise QualError(f"corpus name of {len(name)} characters: at most {MAX_NAME} (it names the corpus's files)")
    return name


def resolve_corpus(name_or_path: str | Path, root: str | Path | None = None) -> Path:
    """Map a corpus name to the first corpora/<name>.jsonl found; a path is returned as it is."""
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or is_path_like(text):
        return Path(text)
    found = paths.find("corpus", check_name(text), corpus_places(root))
    if found is None:
        names = available_corpora(root)
        listed = ", ".join(names) if names else f"none in {searched(root)}"
        raise QualError(
            f'unknown corpus "{text}" (available: {listed}; or give a path to a {SUFFIX} file)'
        )
    return found.path


def to_dataset(requests: Iterable[CorpusRequest]) -> datasets.Dataset:
    """An in-memory `datasets.Dataset` of the requests with fixed column types (no cache files)."""
    _offline_for_local_files()
    import datasets

    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "prompt": datasets.Value("string"),
            "category": datasets.Value("string"),
            "max_tokens": datasets.Value("int64"),
            "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        }
    )
    rows = [
        {"id": r.id, "prompt": r.prompt, "category": r.category, "max_tokens": r.max_tokens,
         "messages": None if r.messages is None else [m.to_json() for m in r.messages]}
        for r in requests
    ]
    return datasets.Dataset.from_list(rows, features=features)


def from_dataset(ds: datasets.Dataset) -> tuple[CorpusRequest, ...]:
    """Requests back from a dataset built by to_dataset."""
    cols = ds.to_dict()
    return tuple(
        CorpusRequest(id=i, prompt=p, category=c, max_tokens=m,
                      messages=None if ms is None else tuple(Message(x["role"], x["content"]) for x in ms))
        for i, p, c, m, ms in zip(
            cols["id"], cols["prompt"], cols["category"], cols["max_tokens"], cols["messages"], strict=True
        )
    )


def _offline_for_local_files() -> None:
    # Local corpora never need the hub; a user's explicit setting still wins.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_corpus(name_or_path: str | Path, root: str | Path | None = None) -> Corpus:
    """Load, validate and fingerprint a corpus given by name (corpora/<name>.jsonl) or path."""
    path = resolve_corpus(name_or_path, root)
    validated = parse_jsonl(path)
    # The typed Arrow round trip is the datasets contract; it must not change a request.
    requests = from_dataset(to_dataset(validated))
    if requests != validated:  # pragma: no cover - would be a datasets bug
        raise QualError(f"{path}: datasets changed the requests while loading")
    name = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.stem
    return Corpus(
        name=name, path=path.resolve(), requests=requests, fingerprint=fingerprint(requests)
    )
