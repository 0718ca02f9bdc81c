"""JSONL corpora: records, strict validation, loading (through `datasets`), manifests, importers."""

from .loader import available_corpora, corpora_dir, load_corpus, resolve_corpus
from .records import Corpus, CorpusRequest, canonical_json, fingerprint
from .validate import CorpusFormatError

__all__ = [
    "Corpus",
    "CorpusFormatError",
    "CorpusRequest",
    "available_corpora",
    "canonical_json",
    "corpora_dir",
    "fingerprint",
    "load_corpus",
    "resolve_corpus",
]
