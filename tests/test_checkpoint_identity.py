"""Checkpoint identity (qual.checkpoints.identity) through `qual run`: a drafter swapped in at the same path is another
configuration: a new series, compared by default with the series before it, which the result records."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sqlite3
import subprocess
import sys

from markdown_it import MarkdownIt

from checkpoints import make_profile
from qual.checkpoints.identity import checkpoint_identity, checkpoint_record


def _perturb(weights) -> None:
    """Change one weight of a safetensors file in place, keeping its size, its name and its modification time: the
    lowest byte of its last element (the end of the file is tensor data; one float's last mantissa bits)."""
    (path,) = sorted(weights.glob("*.safetensors"))
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 8)
        byte = f.read(1)
        f.seek(st.st_size - 8)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p` or `rsync -t` would leave it
    assert path.stat().st_size == st.st_size


def test_identity_follows_content_not_path_or_timestamps(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    profile = make_profile(tmp_path / "p")
    draft = profile.parent / "draft"
    first = checkpoint_identity(draft)
    assert first.startswith("sha256:") and checkpoint_identity(draft) == first  # the cached value, unchanged
    copy = tmp_path / "copy"
    shutil.copytree(draft, copy)
    assert checkpoint_identity(copy) == first  # same content elsewhere: the same checkpoint
    _perturb(draft)
    assert checkpoint_identity(draft) not in (first, None)
    assert checkpoint_record("org/name", "v1") == {"path": "org/name", "revision": "v1", "identity": "hub:org/name@v1"}
    assert checkpoint_record("org/name")["identity"] == "hub:org/name@unpinned"
    assert checkpoint_record(None) is None


def _qual(*args, env, tmp_cwd):
    return subprocess.run([sys.executable, "-m", "qual", *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=tmp_cwd, timeout=600)


def test_a_swapped_drafter_is_another_configuration(tmp_path):
    """A drafter swapped in at the same path is another series: its first night is compared with the last pass of the
    series before it (the key differs only in the drafter), which the result records; a history id of the old series
    is refused unless --baseline-any."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    profile = make_profile(tmp_path / "p")
    db = tmp_path / "h.sqlite"
    common = ["--model", profile, "--dcp", 1, "--tp", 1, "--limit", 2, "--history", db]  # TP 1: no rank processes
    done = _qual("run", *common, "--out", tmp_path / "night1", env=env, tmp_cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    _perturb(profile.parent / "draft")
    nightly = [*common, "--gate", "nightly-baseline", "--baseline", "history:last-pass"]
    by_id = _qual("run", *common, "--gate", "nightly-baseline", "--baseline", "1", "--dry-run", env=env,
                  tmp_cwd=tmp_path)
    line = by_id.stderr.strip().splitlines()[-1]
    assert by_id.returncode == 2 and "is another configuration: draft: this run sha256:" in line, by_id.stderr
    followed = _qual("run", *nightly, "--out", tmp_path / "night2", env=env, tmp_cwd=tmp_path)
    assert followed.returncode in (0, 1), followed.stderr
    assert "baseline run 1 (previous series)" in followed.stdout
    # what differs from the series it is compared with is said where the verdict is, and never "nothing"
    assert ("  another configuration, the last pass of the series before this one: draft: baseline sha256:"
            in followed.stdout)
    assert (f"; pin this night to make it its series' baseline: qual history baseline pin 2 --history {db}"
            in followed.stdout), followed.stdout
    summary = (tmp_path / "night2" / "summary.md").read_text()
    # summary.md's hint is a code span GitHub renders, naming this night's folder: the command it shows pins it
    spans = [c.content for t in MarkdownIt("commonmark").parse(summary) if t.type == "inline" for c in t.children
             if c.type == "code_inline" and c.content.startswith("qual history baseline pin ")]
    assert spans == [f"qual history baseline pin {tmp_path / 'night2'} --history {db}"], summary
    pinned = _qual(*shlex.split(spans[0])[1:], env=env, tmp_cwd=tmp_path)
    assert pinned.returncode == 0 and "run 2 is now the baseline of its configuration" in pinned.stdout, pinned.stderr
    assert "nothing but the time it ran" not in summary and "Differs: both arms draft: sha256:" in summary, summary
    result = json.loads((tmp_path / "night2" / "result.json").read_text())
    before = json.loads((tmp_path / "night1" / "result.json").read_text())
    ids = [r["arms"]["candidate"]["provenance"]["checkpoints"] for r in (before, result)]
    assert ids[0]["target"]["identity"] == ids[1]["target"]["identity"]
    assert ids[0]["draft"]["identity"] != ids[1]["draft"]["identity"]
    assert ids[0]["draft"]["path"] == ids[1]["draft"]["path"]
    b = result["baseline"]
    assert b["forced"] is False and b["chosen_by"] == "previous series"
    assert [d["key"] for d in b["key_differences"]] == ["draft"]
    assert b["key_differences"][0] == {"key": "draft", "tonight": ids[1]["draft"]["identity"],
                                       "baseline": ids[0]["draft"]["identity"]}
    report = (tmp_path / "night2" / "report.html").read_text()
    assert "draft checkpoint" in report and ids[1]["draft"]["identity"] in report
    assert "another configuration, the last pass of the series before this one" in report
    with sqlite3.connect(db) as conn:
        keys = [json.loads(k) for (k,) in conn.execute("SELECT configuration FROM runs ORDER BY id")]
    conn.close()
    assert [k["draft"] for k in keys[:2]] == [ids[0]["draft"]["identity"], ids[1]["draft"]["identity"]]
    assert "engine_version" not in keys[0]  # the engine's version is each night's fact, not the series'


def test_a_revision_for_a_local_directory_is_refused(tmp_path):
    import yaml

    profile = make_profile(tmp_path / "p")
    for key, words in (("target_revision", "is a local directory, identified by its content"),
                       ("draft_revision", "is a local directory, identified by its content")):
        data = {**yaml.safe_load(profile.read_text()), key: "main"}
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump(data))
        done = _qual("run", "--model", path, "--dry-run", env=dict(os.environ), tmp_cwd=tmp_path)
        assert done.returncode == 2 and f"{key}: " in done.stderr and words in done.stderr, done.stderr


def test_attach_mode_refuses_a_revision(tmp_path):
    """An attached server loaded its checkpoints itself: a revision is refused before any server is asked."""
    path = tmp_path / "hub.yaml"
    path.write_text("name: hub\ntarget: org/target\ndraft: org/draft\ndraft_revision: v2\nnum_speculative_tokens: 3\n")
    done = _qual("run", "--model", path, "--dcp", 1, "--control-url", "http://127.0.0.1:9",
                 "--candidate-url", "http://127.0.0.1:9", env=dict(os.environ), tmp_cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "draft_revision: an attached server loaded its checkpoints itself" in done.stderr
