"""The run history for notebooks: `qual.load_history(path)` gives its nights and its series as pandas DataFrames, and
`qual history export` writes them (CSV, or Parquet where pyarrow is installed).

One row a night (`runs`: every column of the history, the configuration key's fields as `key.<field>`, each night's
facts as `facts.<name>` and --meta labels as `meta.<KEY>`) and one row a series (`series`: its key, how many nights
ended how, its latest night and its last pass). Rates are fractions, an undefined one NaN; `created_at` is a UTC
timestamp. pandas is imported when a table is built: `import qual` and the command line never load it.

The CSV is opened in spreadsheets, and a text cell there that starts with =, +, -, @, a tab or a carriage return is
read as a formula: a --meta value such as `=HYPERLINK(...)` would run when the file is opened. The CSV writes such a
cell with a leading ' (OWASP's rule for CSV injection), which spreadsheets show as text; the DataFrames and Parquet
keep every value as it was recorded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path

from qual.configuration import ConfigurationKey
from qual.errors import QualError
from qual.files import write_bytes, write_text
from qual.history.runs import ERROR, FAIL, INCONCLUSIVE, PASS, HistoryRun, list_runs, recorded_order
from qual.history.series import group_series
from qual.nights import FACTS

FORMATS = ("csv", "parquet")
# The columns of a night copied as they are (the rest are spread out: key, facts, meta)
_COLUMNS = ("id", "run_id", "created_at", "outcome", "verdict", "exit_code", "error", "series", "model", "engine",
            "engine_version", "qual_commit", "dcp", "tp", "draft_kv", "corpus_name", "corpus_fingerprint", "n_requests",
            "control_rate", "candidate_rate", "control_mal", "candidate_mal", "delta_rate", "ci_lo", "ci_hi",
            "baseline", "result_path", "run_dir", "command")
_KEY = tuple(f"key.{f.name}" for f in fields(ConfigurationKey))
# A text cell starting with one of these is a formula to a spreadsheet (OWASP, "CSV Injection")
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_COUNTS = {"passes": PASS, "fails": FAIL, "inconclusive": INCONCLUSIVE, "errors": ERROR}  # a series' nights by outcome


def _night(r: HistoryRun) -> dict:
    row = {name: getattr(r, name) for name in _COLUMNS}
    row["failed_checks"] = ", ".join(r.failed_checks)
    row.update({f"key.{k}": v for k, v in (asdict(r.key) if r.key is not None else {}).items()})
    row.update({f"facts.{name}": r.facts.get(name) for name in FACTS})
    row.update({f"meta.{k}": v for k, v in r.meta.items()})
    return row


@dataclass
class History:
    """A history's nights, read typed (a damaged row is exit 2 naming it), and its tables."""

    path: Path
    nights: list[HistoryRun]  # oldest first

    @cached_property
    def runs(self):
        """One row a night, oldest first."""
        import pandas as pd

        rows = [_night(r) for r in self.nights]
        meta = sorted({k for row in rows for k in row if k.startswith("meta.")})
        frame = pd.DataFrame(rows, columns=[*_COLUMNS, "failed_checks", *_KEY, *(f"facts.{n}" for n in FACTS), *meta])
        frame["created_at"] = pd.to_datetime(frame["created_at"], utc=True, errors="coerce")
        return frame

    @cached_property
    def series(self):
        """One row a series: its key, its nights by outcome, its latest night and its last pass."""
        import pandas as pd

        rows = []
        for label, nights in group_series(self.nights).items():
            latest = nights[-1]
            passes = [r for r in nights if r.outcome == PASS]
            rows.append({"series": label, **{f"key.{k}": v for k, v in (asdict(latest.key) if latest.key else {}).items()},
                         "nights": len(nights), **{column: sum(r.outcome == o for r in nights)
                                                   for column, o in _COUNTS.items()},
                         "first": nights[0].created_at, "latest": latest.created_at, "latest_id": latest.id,
                         "latest_outcome": latest.outcome, "latest_control_rate": latest.control_rate,
                         "latest_candidate_rate": latest.candidate_rate,
                         "last_pass_id": passes[-1].id if passes else None})
        frame = pd.DataFrame(rows, columns=["series", *_KEY, "nights", *_COUNTS, "first", "latest", "latest_id",
                                            "latest_outcome", "latest_control_rate", "latest_candidate_rate",
                                            "last_pass_id"])
        for column in ("first", "latest"):
            frame[column] = pd.to_datetime(frame[column], utc=True, errors="coerce")
        return frame


def load_history(path: str | Path) -> History:
    """Every night of a history database (QualError: none there, or a damaged row)."""
    return History(Path(path), sorted(list_runs(path, limit=None), key=recorded_order))


def as_csv_text(frame) -> str:
    """The frame as CSV (RFC 4180), each text cell that a spreadsheet would read as a formula written with a leading '."""
    from pandas.api.types import is_datetime64_any_dtype, is_numeric_dtype

    frame = frame.copy()
    for column in frame.columns:  # text columns only: a negative rate is a number, not a formula
        if not (is_numeric_dtype(frame[column]) or is_datetime64_any_dtype(frame[column])):
            frame[column] = frame[column].map(_inert, na_action="ignore")
    # RFC 4180's CRLF between rows: the csv writer then quotes a cell holding a lone CR, which a "\n"-ended file
    # leaves bare and every reader takes for the end of a row
    return frame.to_csv(index=False, lineterminator="\r\n")


def _inert(value):
    """A text starting like a formula with ' before it; any other value as it is."""
    return "'" + value if isinstance(value, str) and value.startswith(_FORMULA_STARTS) else value


def export(history: History, out_dir: str | Path, fmt: str) -> list[Path]:
    """runs.<fmt> and series.<fmt> in out_dir (written whole, or not at all: qual.files)."""
    if fmt not in FORMATS:
        raise QualError(f"--format {fmt!r}: expected {' or '.join(FORMATS)}")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401  (pandas writes Parquet through it)
        except ImportError:
            raise QualError("--format parquet needs pyarrow (`pip install pyarrow`); --format csv needs nothing "
                            "more") from None
    out = Path(out_dir)
    written = []
    for name in ("runs", "series"):
        frame, path = getattr(history, name), out / f"{name}.{fmt}"
        if fmt == "csv":
            written.append(write_text(path, as_csv_text(frame)))
        else:
            written.append(write_bytes(path, frame.to_parquet(index=False)))
    return written
