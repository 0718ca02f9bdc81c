"""qual.files: an output file is written whole or not at all; a failed write is a WriteError (exit 2)."""

from __future__ import annotations

import errno
import os

import pytest

from qual import files
from qual.errors import QualError
from qual.files import AppendOnly, WriteError, write_text


def _full_disk(*_args, **_kw):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    write_text(path, "old\n")
    monkeypatch.setattr(files.os, "fsync", _full_disk)  # the data did not reach the disk
    with pytest.raises(WriteError, match="cannot write .*result.json: No space left on device") as err:
        write_text(path, "new\n")
    assert isinstance(err.value, QualError) and err.value.errno == errno.ENOSPC
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_a_failed_append_leaves_only_whole_lines(tmp_path, monkeypatch):
    path = tmp_path / "control.requests.jsonl"
    log = AppendOnly(path)
    log.append('{"id": "a"}\n')
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills in the middle of a line
        real_write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "write", half_then_full)
    with pytest.raises(WriteError, match="No space left on device"):
        log.append('{"id": "b"}\n')
    log.close()
    assert path.read_text() == '{"id": "a"}\n'


def test_abandoned_folders_are_the_unheld_ones_of_the_name_and_nothing_else(tmp_path):
    """abandoned_folders returns, locked, only the folders of the prefix and mkdtemp's 8 characters that no process
    holds: not one a locked_folder holds, nor a link, a file, another site's name or a name of another length; a lock
    whose folder was removed or replaced by a link since no longer holds it."""
    held, lock = files.locked_folder(tmp_path, ".s.publish-", "publish")
    left, left_lock = files.locked_folder(tmp_path, ".s.publish-", "publish")
    left_lock.release()  # as a kill -9 drops it
    (tmp_path / ".s.publish-abcdefgh").mkdir()
    (tmp_path / ".s.publish-linked12").symlink_to(tmp_path / ".s.publish-abcdefgh")
    (tmp_path / ".s.publish-afile123").write_text("x")
    for other in (".s.publish-x.publish-abcdefgh", ".s.publish-short", ".t.publish-abcdefgh"):
        (tmp_path / other).mkdir()
    found = files.abandoned_folders(tmp_path, ".s.publish-", "publish")
    assert sorted(p.name for p, _ in found) == sorted([left.name, ".s.publish-abcdefgh"])
    assert all(claim.holds(p) for p, claim in found) and lock.holds(held)
    assert files.abandoned_folders(tmp_path, ".s.publish-", "publish") == []  # the caller holds them now
    for p, claim in found:
        files.remove_tree(p)
        assert not claim.holds(p)
        claim.release()
    files.remove_tree(held)
    held.symlink_to(tmp_path)
    assert not lock.holds(held)
    lock.release()
