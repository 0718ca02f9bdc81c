"""Per-corpus manifest (corpora/<name>.manifest.json): where the prompts came from, their hash."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qual.errors import QualError
from qual.userfiles import MAX_CONFIG_BYTES, read_json

from .records import Corpus

SCHEMA = "qual.corpus-manifest/1"
MANIFEST_SUFFIX = ".manifest.json"


@dataclass(frozen=True)
class CorpusManifest:
    """Provenance and identity of one corpus file."""

    name: str
    file: str  # the corpus file name, beside the manifest
    count: int
    fingerprint: str
    categories: dict[str, int]
    source: dict  # kind: package | jsonl | hf | ..., plus what identifies it
    license: str
    import_command: str
    notes: str = ""
    schema: str = field(default=SCHEMA)

    @classmethod
    def for_corpus(
        cls, corpus: Corpus, source: dict, license: str, import_command: str, notes: str = ""
    ) -> CorpusManifest:
        """The manifest describing `corpus` as it is now."""
        return cls(
            name=corpus.name,
            file=corpus.path.name,
            count=len(corpus),
            fingerprint=corpus.fingerprint,
            categories=corpus.categories,
            source=source,
            license=license,
            import_command=import_command,
            notes=notes,
        )

    def mismatches(self, corpus: Corpus) -> list[str]:
        """How the manifest disagrees with the corpus file (empty when it matches)."""
        out = []
        if self.count != len(corpus):
            out.append(f"count {self.count} != {len(corpus)} in file")
        if self.fingerprint != corpus.fingerprint:
            out.append(f"fingerprint {self.fingerprint} != {corpus.fingerprint} of file")
        if self.categories != corpus.categories:
            out.append("categories differ from file")
        return out


def manifest_path(corpus_path: Path) -> Path:
    """corpora/<name>.jsonl -> corpora/<name>.manifest.json."""
    stem = corpus_path.name.removesuffix(".jsonl")
    return corpus_path.with_name(stem + MANIFEST_SUFFIX)


def manifest_text(manifest: CorpusManifest) -> str:
    """The manifest as stable, human-readable JSON."""
    return json.dumps(asdict(manifest), indent=2, ensure_ascii=False) + "\n"


def read_manifest(path: Path) -> CorpusManifest:
    """Read and check a manifest file; any problem is a one-line QualError."""
    try:
        raw = read_json(path, MAX_CONFIG_BYTES, "manifest")
    except FileNotFoundError:
        raise QualError(f"{path}: manifest missing") from None
    except OSError as exc:
        raise QualError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        raise QualError(f"{path}: not a {SCHEMA} manifest")
    try:
        return CorpusManifest(**raw)
    except TypeError as exc:
        raise QualError(f"{path}: bad manifest fields: {exc}") from None


def manifest_problems(corpus: Corpus) -> list[str] | None:
    """How the corpus's manifest disagrees with its file (empty: it matches); None where it has none. An unreadable
    manifest is a QualError."""
    path = manifest_path(corpus.path)
    return read_manifest(path).mismatches(corpus) if path.exists() else None
