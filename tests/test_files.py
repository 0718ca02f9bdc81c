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
