"""Where a command will write, checked before it does any work: a bad --out or --history is exit 2, not a
traceback after both arms have run. `check_before_work` is the one check `qual run`, `qual compare` and
`qual history publish` make of their output folder and history before they read a model, run an arm or write a
file."""

from __future__ import annotations

import os
from pathlib import Path

from qual.errors import QualError
from qual.files import is_leftover
from qual.userfiles import check_path_name

RUN_FILES = ("run.json", "control.requests.jsonl", "candidate.requests.jsonl")  # what `qual run` leaves in its --out
# Room a command needs before it starts, where the size of what it writes is known: a history row with its
# write-ahead log (a new database: its schema too; SQLite leaves an empty database behind on a full disk), and the
# first files of an output folder (run.json and the first journal lines; the reports' size is known only at the end,
# and a failed write there is exit 2 with its remedy, nothing lost)
HISTORY_ROOM = 256 << 10
OUT_ROOM = 16 << 10


def check_before_work(out: Path | None, history: Path | None, *, history_written: bool = True,
                      create_out: bool = True, out_option: str = "--out", history_option: str = "--history") -> None:
    """Every place a command writes, checked before any work: the names (ones the file system can hold), that the
    history is not the output folder nor inside it (a run fills its folder with its own files, a publish replaces
    its folder whole), the history (a qual database that can take a row, or a new one that can be made: where
    history_written), the output folder (made, or its parent where create_out is False, and writable), and room on
    each file system. A QualError (exit 2) names the option."""
    for path, option in ((out, out_option), (history, history_option)):
        if path is not None:
            check_path_name(path, option)
    if out is not None and history is not None:
        inside = Path(os.path.realpath(history)), Path(os.path.realpath(out))
        if inside[0] == inside[1] or inside[1] in inside[0].parents:
            raise QualError(f"{history_option} {history}: is inside {out_option} {out}, which the command fills with "
                            "its own files (or replaces whole): keep the history outside it")
    if history is not None and history_written:
        from qual.history import check_history

        check_history(history, history_option)
        _check_room(history.parent, history_option, history, HISTORY_ROOM)
    if out is not None:
        output_dir(out if create_out else out.parent, out_option)
        _check_room(out if create_out else out.parent, out_option, out, OUT_ROOM)


def _check_room(folder: Path, option: str, shown: Path, room: int) -> None:
    """At least `room` bytes free on the file system that holds folder (or would: its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return  # not knowable here: the writes will say
    free = st.f_bavail * st.f_frsize
    if free < room:
        raise QualError(f"{option} {shown}: {free // 1024} KiB free on its file system, less than the {room >> 10} KiB "
                        "the command writes before its work: free space")


def leftovers_only(path: Path) -> bool:
    """Whether a folder holds nothing but temporary files a killed qual left behind (qual.files.is_leftover)."""
    try:
        return all(is_leftover(entry.name) and entry.is_file(follow_symlinks=False) for entry in os.scandir(path))
    except OSError:
        return False


def output_dir(path: Path, option: str) -> None:
    """Create the directory (as the run would), or say in one line why it cannot be or cannot be written."""
    check_path_name(path, option)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QualError(f"{option} {path}: cannot create this directory ({exc.strerror or exc})") from None
    # An existing directory is created without a write: its file system may still be read-only, or the folder
    # not ours. Said now, with its cause, not as a failed write (and "free space") after both arms ran.
    if not os.access(path, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
        cause = "its file system is mounted read-only" if read_only else "permission denied"
        raise QualError(f"{option} {path}: cannot write in this directory ({cause})")


def claim_fresh_dir(base: Path, option: str) -> Path:
    """base, or base-2, base-3, ... if it exists: the first that this process creates itself (mkdir is atomic, so two
    runs started in the same second with the default --out each get their own)."""
    output_dir(base.parent, option)
    for n in range(1, 1000):
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise QualError(f"{option} {path}: cannot create this directory ({exc.strerror or exc})") from None
        return path
    raise QualError(f"{option} {base}: it and {base.name}-2 .. -999 exist already")


def holds_run(path: Path) -> str | None:
    """The file that makes `path` a run's directory (`qual run`'s run.json or a journal), or None."""
    return next((name for name in RUN_FILES if (path / name).exists()), None)
