"""JSONL corpora: records, strict validation, loading (through `datasets`), manifests, importers."""

from .loader import available_corpora, corpus_places, load_corpus, named_corpora, resolve_corpus
from .records import Corpus, CorpusRequest, canonical_json, fingerprint
from .validate import CorpusFormatError

__all__ = [
    "Corpus",
    "CorpusFormatError",
    "CorpusRequest",
    "available_corpora",
    "canonical_json",
    "corpus_places",
    "fingerprint",
    "load_corpus",
    "named_corpora",
    "resolve_corpus",
]
