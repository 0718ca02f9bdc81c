"""Name resolution, the datasets round trip, and the fingerprint contract."""

from __future__ import annotations

import json

import pytest

from qual.corpus import Corpus, CorpusRequest, available_corpora, fingerprint, load_corpus
from qual.corpus.loader import from_dataset, to_dataset
from qual.corpus.records import Message
from qual.errors import QualError

ROWS = [
    {"id": "a", "prompt": "def f(x):\n    return x\n", "category": "code", "max_tokens": 8},
    {"id": "b", "prompt": "Ünïcode <script>", "category": "writing"},
    {"id": "c", "prompt": "2 + 2 = ?"},
]


def write_rows(path, rows, **dump_kwargs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, **dump_kwargs) + "\n" for r in rows), encoding="utf-8")
    return path


def test_load_by_path(tmp_path):
    corpus = load_corpus(write_rows(tmp_path / "x.jsonl", ROWS))
    assert isinstance(corpus, Corpus)
    assert corpus.name == "x"
    assert corpus.requests == (
        CorpusRequest("a", ROWS[0]["prompt"], "code", 8),
        CorpusRequest("b", "Ünïcode <script>", "writing", None),
        CorpusRequest("c", "2 + 2 = ?", "default", None),
    )
    assert corpus.categories == {"code": 1, "writing": 1, "default": 1}
    assert corpus.fingerprint.startswith("sha256:") and len(corpus.fingerprint) == 7 + 64


def test_load_by_name_from_root(tmp_path):
    write_rows(tmp_path / "corpora" / "mine.jsonl", ROWS)
    assert (
        load_corpus("mine", root=tmp_path).path == (tmp_path / "corpora" / "mine.jsonl").resolve()
    )
    assert available_corpora(tmp_path) == ["mine"]


def test_unknown_name_lists_available(tmp_path):
    write_rows(tmp_path / "corpora" / "one.jsonl", ROWS)
    write_rows(tmp_path / "corpora" / "two.jsonl", ROWS)
    with pytest.raises(QualError, match=r'unknown corpus "three" \(available: one, two;'):
        load_corpus("three", root=tmp_path)


def test_default_root_is_the_checkout():
    assert {"humaneval", "mt-bench", "gsm8k", "smoke"} <= set(available_corpora())


def test_fingerprint_ignores_formatting(tmp_path):
    compact = load_corpus(write_rows(tmp_path / "a.jsonl", ROWS, separators=(",", ":")))
    spaced = load_corpus(write_rows(tmp_path / "b.jsonl", ROWS, indent=None, ensure_ascii=False))
    # same requests, keys reordered, padded with whitespace, explicit nulls / default category
    reordered = [
        {"max_tokens": 8, "category": "code", "prompt": ROWS[0]["prompt"], "id": "a"},
        {"category": "writing", "id": "b", "prompt": "Ünïcode <script>", "max_tokens": None},
        {"id": "c", "prompt": "2 + 2 = ?", "category": "default"},
    ]
    path = tmp_path / "c.jsonl"
    path.write_text(
        "".join(
            "  " + json.dumps(r, indent=None, separators=(" , ", " :  ")) + "\t\n"
            for r in reordered
        )
    )
    assert compact.fingerprint == spaced.fingerprint == load_corpus(path).fingerprint


def test_fingerprint_changes_with_content(tmp_path):
    base = load_corpus(write_rows(tmp_path / "a.jsonl", ROWS)).fingerprint
    changed_prompt = [dict(ROWS[0], prompt=ROWS[0]["prompt"] + " "), *ROWS[1:]]
    changed_cat = [dict(ROWS[0], category="math"), *ROWS[1:]]
    changed_max = [dict(ROWS[0], max_tokens=9), *ROWS[1:]]
    reordered = [ROWS[1], ROWS[0], ROWS[2]]
    others = {
        load_corpus(write_rows(tmp_path / f"{i}.jsonl", rows)).fingerprint
        for i, rows in enumerate([changed_prompt, changed_cat, changed_max, reordered, ROWS[:2]])
    }
    assert base not in others and len(others) == 5


def test_fingerprint_is_the_documented_function():
    reqs = [CorpusRequest("a", "p")]
    import hashlib

    canon = b'[{"category":"default","id":"a","max_tokens":null,"prompt":"p"}]'
    assert fingerprint(reqs) == "sha256:" + hashlib.sha256(canon).hexdigest()


def test_dataset_has_typed_columns():
    chat = CorpusRequest("c", None, messages=(Message("user", "hi"), Message("assistant", None), Message("user", "more")))
    ds = to_dataset([CorpusRequest("a", "p", "code", 4), CorpusRequest("b", "q"), chat])
    assert ds.column_names == ["id", "prompt", "category", "max_tokens", "messages"]
    assert ds["max_tokens"] == [4, None, None]
    assert ds["messages"][2] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                                 {"role": "user", "content": "more"}]
    assert from_dataset(ds)[2] == chat and from_dataset(ds)[0].messages is None


def test_loading_is_offline(tmp_path):
    load_corpus("smoke")  # sets the offline switches before `datasets` is imported
    import os

    assert os.environ.get("HF_HUB_OFFLINE") and os.environ.get("HF_DATASETS_OFFLINE")
    corpus = load_corpus("humaneval")
    assert len(corpus) == 164
