"""Importer for Hugging Face datasets (`hf:<dataset>[:<config>]`) via `datasets.load_dataset`."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

from qual.errors import QualError

from .imported import Imported, validate_rows

PREFIX = "hf:"
PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class HubSpec:
    """A parsed `hf:` SOURCE."""

    dataset: str
    config: str | None

    @classmethod
    def parse(cls, source: str) -> HubSpec:
        body = source.removeprefix(PREFIX)
        dataset, _, config = body.partition(":")
        if not dataset:
            raise QualError(f"bad source {source!r}: expected hf:<dataset>[:<config>]")
        return cls(dataset=dataset, config=config or None)

    def __str__(self) -> str:
        return PREFIX + self.dataset + (f":{self.config}" if self.config else "")


def _offline_requested() -> bool:
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _probe_hub(spec: HubSpec) -> None:
    """Fail fast with one line when the hub endpoint cannot be reached.

    Without this, datasets retries for ~25 s and logs each attempt.
    """
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise QualError(
            f"{spec}: no Hugging Face hub reachable at {constants.ENDPOINT} ({reason}); "
            "import from a JSONL file or a package source instead"
        ) from None


def import_hub(
    source: str,
    split: str | None,
    prompt_field: str,
    id_field: str | None,
    category_field: str | None,
    limit: int | None,
) -> Imported:
    """Load a hub dataset split and map its columns onto requests."""
    spec = HubSpec.parse(source)
    if not _offline_requested():  # offline: datasets may still serve it from its cache
        _probe_hub(spec)
    import datasets

    try:
        loaded = datasets.load_dataset(spec.dataset, spec.config, split=split)
    except Exception as exc:  # datasets raises many types; all mean "could not load"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise QualError(f"{spec}: cannot load dataset: {first}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if len(splits) != 1:
            raise QualError(f"{spec} has splits {', '.join(splits)}: choose one with --split")
        split = splits[0]
        loaded = loaded[split]
    ds = loaded
    columns = set(ds.column_names)
    for opt, col in (
        ("--prompt-field", prompt_field),
        ("--id-field", id_field),
        ("--category-field", category_field),
    ):
        if col is not None and col not in columns:
            raise QualError(
                f"{spec}[{split}]: no column {col!r} for {opt} (columns: {', '.join(ds.column_names)})"
            )
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    where = f"{spec}[{split}]"
    rows = []
    for i, row in enumerate(ds):
        rec = {
            "id": str(row[id_field]) if id_field else f"{spec.dataset.split('/')[-1]}-{i}",
            "prompt": row[prompt_field],
        }
        if category_field:
            rec["category"] = (
                row[category_field] if row[category_field] is None else str(row[category_field])
            )
        rows.append((f"{where}:row {i}", rec))
    source_info = {
        "kind": "hf",
        "dataset": spec.dataset,
        "config": spec.config,
        "split": split,
        "datasets": datasets.__version__,
        "fields": {"prompt": prompt_field, "id": id_field, "category": category_field},
        "selection": f"first {limit} rows" if limit is not None else "all rows",
    }
    license = (ds.info.license or "").strip() or "unknown (the dataset card names none)"
    return Imported(requests=validate_rows(rows, where), source=source_info, license=license)
