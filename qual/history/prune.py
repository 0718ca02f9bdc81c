"""`qual history prune DIR --keep N`: bound a CI job's run directories without losing a baseline.

The newest N run directories under DIR stay (newest by name, its numbers compared as numbers: `<run id>-<attempt>`
names grow with the run id), and so does every directory a baseline may still be read from (pins, each series' last
pass: qual.history.baselines.baseline_result_paths). Only qual's run directories are removed (a folder holding
run.json, or an empty one); anything else under DIR, a link, and a run directory a qual process holds (a night
still running there), is left as it is and named. The history keeps every row: `qual history show` of a pruned night
still says where its result was.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qual.errors import QualError
from qual.files import DirectoryBusy, DirectoryLock, remove_tree
from qual.history.baselines import baseline_result_paths
from qual.validation import ascii_digits

RUN_FILE = "run.json"  # what `qual run` writes first into its --out


@dataclass
class Pruned:
    """What a prune kept and removed (paths as under DIR)."""

    kept: list[str] = field(default_factory=list)  # run directories kept: the newest, and the baselines'
    removed: list[str] = field(default_factory=list)
    baselines: list[str] = field(default_factory=list)  # of kept, those kept only because a baseline reads them
    left: list[tuple[str, str]] = field(default_factory=list)  # (path, why) of what is not a run directory

    def to_json(self) -> dict:
        return {**asdict(self), "left": [{"path": p, "why": why} for p, why in self.left]}


def _order(name: str) -> list:
    """'100-1' after '99-1': runs of digits compare as numbers."""
    return [int(part) if ascii_digits(part) else part for part in re.split(r"([0-9]+)", name)]


def _tail(relative: Path) -> tuple[str, ...]:
    """A relative path's parts after any leading '..' (what any folder it was recorded from ends with)."""
    parts = Path(os.path.normpath(relative)).parts
    while parts and parts[0] in ("..", "."):
        parts = parts[1:]
    return parts


def _remove_run_directory(entry: Path) -> None:
    """Remove a run directory, its run.json last: a prune stopped part-way (a cancelled CI step's SIGTERM) leaves a
    run directory the next prune still recognises and finishes, never a folder of orphaned files it must leave."""
    for child in entry.iterdir():
        if child.name == RUN_FILE:
            continue
        if child.is_dir() and not child.is_symlink():
            remove_tree(child)
        else:
            try:
                child.unlink()
            except OSError:
                pass  # what cannot be removed stays: said by the caller, not guessed
    if all(child.name == RUN_FILE for child in entry.iterdir()):  # else run.json stays with what could not go
        remove_tree(entry)


def prune(runs_dir: str | Path, keep: int, history: str | Path) -> Pruned:
    """Remove the run directories under runs_dir beyond the newest `keep` that no baseline reads."""
    root = Path(runs_dir)
    done = Pruned()
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise QualError(f"{root}: not a folder of run directories")
    if not root.is_dir():
        return done  # no night has run yet
    history = Path(history)
    recorded = [Path(p).parent for p in baseline_result_paths(history)] if history.is_file() else []
    needed = {p.resolve() for p in recorded}
    # A relative path was recorded from the working directory of its run (a CI job's reports/runs/<id>): pruning from
    # another folder must still keep it, so a run directory whose path ends with one is a baseline's too.
    tails = {_tail(p) for p in recorded if not p.is_absolute()} - {()}
    runs = []
    for entry in sorted(root.iterdir(), key=lambda p: _order(p.name)):
        if entry.is_symlink() or not entry.is_dir():
            done.left.append((str(entry), "a link" if entry.is_symlink() else "not a folder"))
        elif (entry / RUN_FILE).is_file() or not any(entry.iterdir()):
            runs.append(entry)
        else:
            done.left.append((str(entry), f"no {RUN_FILE}: not a qual run directory"))
    for i, entry in enumerate(runs):
        if i >= len(runs) - keep:
            done.kept.append(str(entry))
        elif entry.resolve() in needed or any(entry.resolve().parts[-len(t):] == t for t in tails):
            done.kept.append(str(entry))
            done.baselines.append(str(entry))
        else:
            try:  # a night still writing it (qual run --out, --resume) holds it: never removed from under that night
                lock = DirectoryLock(entry, "run directory")
            except DirectoryBusy:
                done.left.append((str(entry), "in use by a running qual process"))
                continue
            try:
                _remove_run_directory(entry)
            finally:
                lock.release()
            if entry.exists():  # what could not be removed (permissions) stays: said, not guessed
                raise QualError(f"cannot remove {entry} (removed before it: {len(done.removed)})")
            done.removed.append(str(entry))
    return done
