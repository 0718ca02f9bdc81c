"""What every importer hands back: validated requests plus where they came from."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .records import CorpusRequest
from .validate import CorpusFormatError, check_requests, line_of, request_from_mapping


@dataclass(frozen=True)
class Imported:
    """Requests taken from a source, with the provenance a manifest records."""

    requests: tuple[CorpusRequest, ...]
    source: dict
    license: str
    notes: str = ""


def validate_rows(
    rows: Iterable[tuple[str, Any]], where: str, problems: list[str] | None = None
) -> tuple[CorpusRequest, ...]:
    """Validate (location, record) pairs mapped from a source; every bad row is named.

    `problems` carries upstream problems found before mapping (bad JSON, missing fields).
    """
    problems = list(problems or [])
    located: list[tuple[str, CorpusRequest]] = []
    for loc, obj in rows:
        req, errs = request_from_mapping(obj, loc)
        if errs:
            problems.extend(errs)
        else:
            located.append((loc, req))
    if problems:
        problems.sort(key=lambda p: line_of(p, where))
        raise CorpusFormatError(problems, where)
    return check_requests(located, where)
