"""`qual corpus import`: requests from a source -> corpora/<name>.jsonl plus its manifest."""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from qual.errors import QualError
from qual.files import write_text
from qual.userfiles import check_path_name

from .hub import PREFIX as HUB_PREFIX
from .hub import import_hub
from .imported import Imported
from .loader import SUFFIX, check_name, import_folder, load_corpus
from .manifest import CorpusManifest, manifest_path, manifest_text
from .packages import PACKAGE_SOURCES, import_package
from .records import Corpus, CorpusRequest
from .validate import display_path, parse_jsonl_bytes, read_corpus_bytes

UNKNOWN_LICENSE = "unknown (not recorded at import; pass --license)"


@dataclass(frozen=True)
class ImportOptions:
    """Everything `qual corpus import` takes; also rebuilds the command for the manifest."""

    source: str
    name: str
    limit: int | None = None
    split: str | None = None
    prompt_field: str = "prompt"
    id_field: str | None = None
    category_field: str | None = None
    license: str | None = None

    def command(self) -> str:
        """The exact command that reproduces this import (add --force to overwrite)."""
        argv = ["qual", "corpus", "import", self.source, "--name", self.name]
        if self.limit is not None:
            argv += ["--limit", str(self.limit)]
        if self.source.startswith(HUB_PREFIX):
            if self.split is not None:
                argv += ["--split", self.split]
            argv += ["--prompt-field", self.prompt_field]
            if self.id_field:
                argv += ["--id-field", self.id_field]
            if self.category_field:
                argv += ["--category-field", self.category_field]
        if self.license is not None:
            argv += ["--license", self.license]
        return shlex.join(argv)


def _source_kind(source: str) -> str:
    if source in PACKAGE_SOURCES:
        return "package"
    if source.startswith(HUB_PREFIX):
        return "hf"
    check_path_name(source, "SOURCE")  # a name the file system refuses (ENAMETOOLONG) is exit 2, not a crash
    if source.endswith(SUFFIX) or Path(source).is_file():
        return "jsonl"
    names = ", ".join(PACKAGE_SOURCES)
    raise QualError(
        f"unknown source {source!r}: use one of {names}, a path to a {SUFFIX} file, or hf:<dataset>[:<config>]"
    )


def _import_jsonl(path: Path, limit: int | None, root: Path) -> Imported:
    data = read_corpus_bytes(path)  # read once: the hash is of the bytes parsed
    requests = parse_jsonl_bytes(data, display_path(path))
    if limit is not None:
        requests = requests[:limit]
    try:
        shown = str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        shown = str(path)
    source = {
        "kind": "jsonl",
        "path": shown,
        "sha256": hashlib.sha256(data).hexdigest(),
        "selection": f"first {limit} requests" if limit is not None else "all requests, file order",
    }
    return Imported(requests=requests, source=source, license=UNKNOWN_LICENSE)


def collect(opts: ImportOptions, root: Path) -> Imported:
    """Read the source named in opts into validated requests (nothing written)."""
    kind = _source_kind(opts.source)
    if kind != "hf" and (
        opts.split is not None
        or opts.id_field
        or opts.category_field
        or opts.prompt_field != "prompt"
    ):
        raise QualError(
            "--split, --prompt-field, --id-field and --category-field apply to hf: sources only"
        )
    if kind == "package":
        return import_package(opts.source, opts.limit)
    if kind == "hf":
        return import_hub(
            opts.source,
            opts.split,
            opts.prompt_field,
            opts.id_field,
            opts.category_field,
            opts.limit,
        )
    return _import_jsonl(Path(opts.source), opts.limit, root)


def render_jsonl(requests: tuple[CorpusRequest, ...]) -> str:
    """The normalized file form: one compact object a line, fields in contract order."""
    return "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in requests)


def import_corpus(
    opts: ImportOptions, root: str | Path | None = None, force: bool = False, into: str | Path | None = None
) -> tuple[Corpus, CorpusManifest]:
    """Import opts.source as <folder>/<name>.jsonl plus its manifest, the folder `into` or else
    loader.import_folder(root); refuse to overwrite unless force."""
    check_name(opts.name)
    if into is not None:
        check_path_name(str(into), "--into")
    folder = Path(into) if into is not None else import_folder(root)
    base = folder.parent
    dest = folder / f"{opts.name}{SUFFIX}"
    if dest.exists() and not force:
        raise QualError(f"{display_path(dest)} already exists: pass --force to overwrite")
    imported = collect(opts, base)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QualError(f"cannot create the corpora folder {display_path(folder)}: {exc.strerror or exc}") from None
    write_text(dest, render_jsonl(imported.requests))
    corpus = load_corpus(dest)
    if corpus.requests != imported.requests:  # pragma: no cover - writer/loader disagree
        raise QualError(f"{display_path(dest)}: written corpus does not read back identically")
    manifest = CorpusManifest.for_corpus(
        corpus,
        source=imported.source,
        license=opts.license or imported.license,
        import_command=opts.command(),
        notes=imported.notes,
    )
    mpath = manifest_path(dest)
    write_text(mpath, manifest_text(manifest))
    return corpus, manifest
