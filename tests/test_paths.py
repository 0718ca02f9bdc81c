"""Where profiles, gates and corpora are found: $QUAL_ROOT, then the checkout's root folders, then the package's copy
(qual/paths.py); what says where each came from; where `qual corpus import` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_inprocess import qual_in
from qual import paths
from qual.corpus.loader import import_folder, named_corpora
from qual.gate import load_gate
from qual.profiles import load_profile

REPO = Path(__file__).resolve().parents[1]


def test_a_checkout_reads_the_root_folders():
    """Run from the repository, the files at its top are the ones used: no copy under qual/data."""
    assert paths.source_checkout() == REPO
    assert paths.places("profile") == [paths.Place(REPO / "configs" / "models", "checkout")]
    assert paths.places("gate") == [paths.Place(REPO / "configs" / "gates", "checkout")]
    assert paths.places("corpus") == [paths.Place(REPO / "corpora", "checkout")]
    assert paths.default_gate() == REPO / "configs" / "gates" / "nightly.yaml"
    assert load_profile("toy").path == str(REPO / "configs" / "models" / "toy.yaml")
    assert not (paths.DATA_DIR / "configs").exists() and not (paths.DATA_DIR / "corpora").exists()


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """A $QUAL_ROOT holding its own nightly gate (one rule), a profile and a corpus of its own."""
    root = tmp_path / "root"
    (root / "configs" / "gates").mkdir(parents=True)
    (root / "configs" / "models").mkdir(parents=True)
    (root / "corpora").mkdir()
    (root / "configs" / "gates" / "nightly.yaml").write_text("rules:\n  - {check: candidate_runnable}\n")
    toy = (REPO / "configs" / "models" / "toy.yaml").read_text()
    (root / "configs" / "models" / "mine.yaml").write_text(toy.replace("models/toy/", str(paths.MODELS_DIR / "toy") + "/"))
    (root / "corpora" / "tiny.jsonl").write_text(json.dumps({"id": "a", "prompt": "def f():"}) + "\n")
    monkeypatch.setenv("QUAL_ROOT", str(root))
    return root


def test_qual_root_comes_first_and_the_shipped_files_stay_visible(root):
    assert [p.origin for p in paths.places("gate")] == ["QUAL_ROOT", "checkout"]
    assert paths.default_gate() == root / "configs" / "gates" / "nightly.yaml"
    assert [r.check for r in load_gate("nightly").rules] == ["candidate_runnable"]  # the team's, not the shipped one
    assert load_gate("nightly-baseline").source == str(REPO / "configs" / "gates" / "nightly-baseline.yaml")
    assert load_profile("mine").path == str(root / "configs" / "models" / "mine.yaml")
    found = named_corpora()
    assert found["tiny"] == paths.Found(root / "corpora" / "tiny.jsonl", "QUAL_ROOT")
    assert found["humaneval"].origin == "checkout"
    assert paths.origin(root / "corpora" / "tiny.jsonl") == "QUAL_ROOT"
    assert paths.origin(REPO / "corpora" / "smoke.jsonl") == "checkout"
    assert paths.origin(root / "elsewhere.jsonl") == "a path given"


def test_the_dry_run_says_where_each_file_came_from(root, capsys, tmp_path):
    proc = qual_in(capsys, "run", "--model", "mine", "--corpus", "humaneval", "--limit", 1, "--dcp", 2, "--dry-run",
                   "--history", tmp_path / "h.sqlite")
    assert proc.returncode == 0, proc.stderr
    assert f"# profile file: {root / 'configs' / 'models' / 'mine.yaml'} (QUAL_ROOT)" in proc.stdout
    assert f"# gate file: {root / 'configs' / 'gates' / 'nightly.yaml'} (QUAL_ROOT)" in proc.stdout
    assert f"# corpus file: {REPO / 'corpora' / 'humaneval.jsonl'} (checkout)" in proc.stdout


def test_corpus_list_and_doctor_name_the_origin(root, capsys):
    listing = qual_in(capsys, "corpus", "list")
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[1]: line for line in listing.stdout.splitlines() if line.startswith("│")}
    assert "QUAL_ROOT" in rows["tiny"] and "checkout" in rows["humaneval"]
    doctor = qual_in(capsys, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert "mine (QUAL_ROOT)" in checks["profiles"]["detail"] and "toy (checkout)" in checks["profiles"]["detail"]
    assert "nightly (QUAL_ROOT)" in checks["gates"]["detail"]
    assert checks["corpora"]["evidence"] == [f"searched {root / 'corpora'} (QUAL_ROOT)",
                                             f"searched {REPO / 'corpora'} (checkout)"]


def test_corpus_import_writes_into_qual_root_or_into(root, tmp_path, capsys):
    src = tmp_path / "src.jsonl"
    src.write_text(json.dumps({"id": "x", "prompt": "p"}) + "\n")
    assert import_folder() == root / "corpora"
    made = qual_in(capsys, "corpus", "import", src, "--name", "fresh")
    assert made.returncode == 0, made.stderr
    assert (root / "corpora" / "fresh.jsonl").is_file() and (root / "corpora" / "fresh.manifest.json").is_file()
    into = tmp_path / "elsewhere" / "corpora"
    made = qual_in(capsys, "corpus", "import", src, "--name", "other", "--into", into)
    assert made.returncode == 0 and (into / "other.jsonl").is_file() and not (root / "corpora" / "other.jsonl").exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    refused = qual_in(capsys, "corpus", "import", src, "--name", "z", "--into", blocked / "corpora")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "cannot create the corpora folder" in refused.stderr


def test_without_qual_root_a_checkout_imports_into_its_corpora_folder(monkeypatch):
    monkeypatch.delenv("QUAL_ROOT", raising=False)
    assert import_folder() == REPO / "corpora"


def test_a_name_with_a_dot_is_a_name():
    """`glm-5.3-flash` is a profile's name, not a file with the suffix `.3-flash`."""
    assert load_profile("glm-5.3-flash").path == str(REPO / "configs" / "models" / "glm-5.3-flash.yaml")
