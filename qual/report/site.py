"""The published site of a run history (`qual history publish DIR`): an index of the configurations with an overview
plot, one page per configuration (its trends across nights, its runs, its key), a page of the step changes, and each
night's report copied into the site, linking back to its configuration's page. Every plot runs along one axis
(`--axis date|engine|qual|meta:KEY`, as `qual history trend`).

Static and offline like report.html: inline CSS and SVG, no scripts, no fetches, relative links only, so DIR reads
the same from file://, as a CI artifact and on GitHub Pages. The site is built from the history and the run folders
first (records below), then rendered; it is written into a new folder beside DIR that replaces DIR whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, fields, replace
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

from markupsafe import Markup, escape

from qual import history as hist
from qual.configuration import ConfigurationKey
from qual.errors import QualError
from qual.files import WriteError, abandoned_folders, copy_file, locked_folder, remove_tree, write_text
from qual.report import html, plots, trend
from qual.sweep_result import SweepResult, load_any
from qual.userfiles import check_path_name, read_json, read_text

MARKER = "qual-site.json"  # names a folder as a site qual published: only such a folder is replaced
RUNS, PAGES = "runs", "configurations"
REPORT, RESULT, SUMMARY = "report.html", "result.json", "summary.md"
REGRESSIONS = "regressions.html"
MAX_REPORT_BYTES = 1 << 28  # a report.html read for its links: every request is a row of it, but bounded
MAX_COPIED_BYTES = 1 << 28  # a file of a run's folder copied into the site (a journal, a log); larger ones stay out
MAX_MARKER_BYTES = 1 << 24


@dataclass(frozen=True)
class Night:
    """One recorded run as the site shows it."""

    run: hist.HistoryRun
    sources: tuple[tuple[Path, str], ...] = ()  # (file in the run's folder, its name under runs/<id>/), report first
    per_position: tuple[float | None, ...] | None = None  # the candidate's unconditional acceptance per draft position
    missing: str | None = None  # why the night comes from its history row only

    @property
    def folder(self) -> str:
        return f"{RUNS}/{self.run.id}"

    @property
    def report(self) -> str | None:
        """The night's page relative to DIR: its report.html, else its result.json (an error night: its summary.md);
        None when nothing was copied."""
        names = [name for _, name in self.sources]
        for name in (REPORT, RESULT, SUMMARY):
            if name in names:
                return f"{self.folder}/{name}"
        return None

    @property
    def commit(self) -> str:
        return (self.run.qual_commit or "n/a")[:7]

    @property
    def date(self) -> str:
        return self.run.created_at[:10]

    @property
    def when(self) -> str:
        return self.run.created_at[:16].replace("T", " ")

    @property
    def failed(self) -> bool:
        """Not a pass: failed, inconclusive (even where it exited 0) or without a verdict."""
        return self.run.outcome != hist.PASS


@dataclass(frozen=True)
class Configuration:
    """One configuration key's runs, oldest first."""

    slug: str  # a short hash of the key: the page's file name
    key: ConfigurationKey | None  # None: runs recorded without a candidate arm in their config
    label: str  # what a person reads: model, DCP, draft KV, drafter (and what else tells it from a like one)
    nights: tuple[Night, ...]
    series: str = ""  # the key's full label (hashes and all): `qual history trend`'s name for it
    steps: tuple[hist.StepChange, ...] = ()  # jumps between consecutive measured nights (hist.detect_step_changes)

    @property
    def page(self) -> str:
        return f"{PAGES}/{self.slug}.html"

    @property
    def latest(self) -> Night:
        return self.nights[-1]

    @property
    def fields(self) -> list[tuple[str, object]]:
        return list(asdict(self.key).items()) if self.key is not None else [("series", self.label)]


@dataclass(frozen=True)
class Site:
    history: Path
    configurations: list[Configuration]
    axis: str = "date"  # what every plot runs along (qual.nights.check_axis)
    threshold_pp: float = hist.DEFAULT_STEP_PP  # the least jump a step change is

    @property
    def nights(self) -> list[Night]:
        return [n for c in self.configurations for n in c.nights]


# ---------------------------------------------------------------- reading the history and the run folders


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.hrefs.extend(v for k, v in attrs if k == "href" and v)


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _linked(run_dir: Path, report: Path) -> list[tuple[Path, str]]:
    """The files inside run_dir that report.html links to (relative links only: a log kept elsewhere is not copied,
    and its link in the copy leads nowhere)."""
    parser = _Links()
    try:
        parser.feed(read_text(report, MAX_REPORT_BYTES, "report"))
    except (OSError, QualError):  # unreadable, or not a report qual wrote: its links are not followed
        return []
    root, out = run_dir.resolve(), []
    for href in parser.hrefs:
        parts = urlsplit(href)
        if parts.scheme or parts.netloc or not parts.path or parts.path.startswith("/"):
            continue
        path = run_dir / unquote(parts.path)
        try:
            name = path.resolve().relative_to(root).as_posix()
        except ValueError:
            continue
        if _regular(path) and name not in (n for _, n in out) and name != REPORT:
            out.append((path, name))
    return out


def night(run: hist.HistoryRun) -> Night:
    """A run with what its folder still holds: its result (read for the per-position rates, and to check that the
    folder holds this run and not a later one written to the same --out), its report and the files that links to."""
    if run.is_error:
        return _error_night(run)
    if not run.result_path:
        return Night(run, missing="no result file recorded")
    result_path = Path(run.result_path)  # a relative path is read from the working directory, as --baseline does
    if not _regular(result_path):
        return Night(run, missing=f"result file {result_path} is missing")
    try:
        result = load_any(result_path)
    except QualError as exc:
        return Night(run, missing=f"result file unreadable ({exc})")
    if isinstance(result, SweepResult):  # a sweep's row is one comparison: "<run id>/<candidate>"
        name = (run.run_id or "").rpartition("/")[2]
        result = dict(result.results()).get(name)
        if result is None:
            return Night(run, missing=f"{result_path} holds no comparison {name!r}")
    run_dir = result_path.parent
    if not _same_run(run, run_dir) and result.created_at != run.created_at:
        return Night(run, missing=f"{result_path} now holds a run of {result.created_at}")
    sources = [(result_path, RESULT)]
    report = run_dir / REPORT
    if _regular(report):
        sources = [(report, REPORT), *[(p, n) for p, n in _linked(run_dir, report) if n != RESULT], *sources]
    return Night(run, tuple(sources), tuple(result.candidate.acceptance.per_position))


def _error_night(run: hist.HistoryRun) -> Night:
    """A night that ended without a verdict: its cause is in its row; its folder's summary.md says why at length."""
    summary = Path(run.run_dir) / SUMMARY if run.run_dir else None
    if summary is None or not _regular(summary) or not _same_run(run, summary.parent):
        return Night(run, missing=f"no verdict (exit {run.exit_code}), no {SUMMARY} of it here")
    return Night(run, ((summary, SUMMARY),))


def _same_run(run: hist.HistoryRun, run_dir: Path) -> bool:
    """The folder's run.json names the row's run (a resumed run rewrites result.json, with a later created_at)."""
    if not run.run_id:
        return False
    try:
        plan = read_json(run_dir / "run.json", what="run.json")
    except (OSError, QualError):
        return False
    return isinstance(plan, dict) and plan.get("run_id") == run.run_id.partition("/")[0]


def slug(identity: str) -> str:
    """A configuration's page name: 12 hex digits of SHA-256 over its key (any file system takes it)."""
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def build(history_path: str | Path, axis: str = "date", threshold_pp: float = hist.DEFAULT_STEP_PP) -> Site:
    """Every configuration of the history with its nights (QualError: no history, or no runs in it)."""
    runs = hist.list_runs(history_path, limit=None)
    if not runs:
        raise QualError(f"no runs recorded in {history_path}: nothing to publish")
    groups: dict[str, list[hist.HistoryRun]] = {}
    for run in sorted(runs, key=hist.recorded_order):
        groups.setdefault(run.configuration or run.series, []).append(run)
    labels = readable_labels([rows[0] for rows in groups.values()])
    configurations = [Configuration(slug(identity), rows[0].key, label, tuple(night(r) for r in rows), rows[0].series,
                                    tuple(hist.detect_step_changes(rows, threshold_pp)))
                      for label, (identity, rows) in zip(labels, groups.items())]
    # The configurations whose latest night failed come first; then by label.
    configurations.sort(key=lambda c: (not c.latest.failed, c.label))
    return Site(Path(history_path), configurations, axis, threshold_pp)


def drafter(run: hist.HistoryRun) -> str:
    """The drafter's short name: the last two parts of its path or hub id ('toy/draft'); 'no drafter'."""
    path = ((run.config or {}).get("candidate") or {}).get("draft_path")
    return "/".join(str(path).replace("\\", "/").rstrip("/").split("/")[-2:]) if path else "no drafter"


def readable_labels(first: list[hist.HistoryRun]) -> list[str]:
    """A label a person reads for each configuration (given by its first night): model, DCP, draft KV and drafter,
    then the key fields in which configurations of the same such label differ (their hashes stay in the detail)."""
    base = [" \u00b7 ".join((r.key.model, f"DCP {r.key.dcp}", f"draft KV {r.key.draft_kv}", drafter(r)))
            if r.key is not None else r.series for r in first]
    out = []
    for i, r in enumerate(first):
        alike = [o for j, o in enumerate(first) if base[j] == base[i] and j != i and o.key is not None]
        if r.key is None or not alike:
            out.append(base[i])
            continue
        names = {name for o in alike for name, _, _ in r.key.differences(o.key)}
        shown = [f"{f.name} {_brief(getattr(r.key, f.name))}" for f in fields(r.key) if f.name in names]
        out.append(" \u00b7 ".join([base[i], *shown]))
    return out


def _brief(value: object) -> str:
    text = str(value)
    return text[:14] if text.startswith("sha256:") else text


# ---------------------------------------------------------------- rendering


def _columns(conf: Configuration, axis: str, up: str = "../", page: str = "") -> list[plots.Column]:
    """Each night of conf on a plot along axis, linking to its report (up: the way from the plot's page to DIR), else
    to its row on conf's page (page: the way there), which says why it has none."""
    return [trend.column(n.run, axis, f"{up}{n.report}" if n.report else f"{page}#run-{n.run.id}", n.missing,
                         hollow=n.report is None) for n in conf.nights]


def chart(conf: Configuration, site: Site) -> Markup:
    """The configuration page's plot: both arms' acceptance (its step changes ringed) and, below it on the same axis,
    the candidate's per draft position, numbered from 0 as the report does (no panel where no night has its
    result file)."""
    nights, columns = conf.nights, _columns(conf, site.axis)
    panels = [trend.arms_panel("", [n.run for n in nights], columns, conf.steps)]
    k = max((len(n.per_position) for n in nights if n.per_position), default=0)
    if k:
        lines = [(f"position {i}", color, [n.per_position[i] if n.per_position and i < len(n.per_position) else None
                                           for n in nights]) for i, color in enumerate(plots.position_colors(k))]
        panels.append(plots.Panel("candidate per position (%)", columns, lines))
    return Markup(plots.nights_svg(panels, site.axis))  # built from numbers, its text escaped: safe to inline


def overview(site: Site) -> Markup:
    """The index's plot: every configuration's acceptance on one shared axis, each titled by its label and linking
    to its page."""
    panels = [trend.arms_panel(c.label, [n.run for n in c.nights], _columns(c, site.axis, "", c.page), c.steps, c.page)
              for c in site.configurations]
    return Markup(plots.nights_svg(panels, site.axis, "overview", panel_height=1.9))


@dataclass(frozen=True)
class Step:
    """A step change as the regressions page lists it: with its configuration and the nights around it."""

    change: hist.StepChange
    conf: Configuration
    around: tuple[Night, ...]  # the night before the step's earlier night through the one after its later


def steps(site: Site) -> list[Step]:
    """The site's step changes, newest first, each with the nights around it."""
    out = []
    for conf in site.configurations:
        ids = [n.run.id for n in conf.nights]
        for change in conf.steps:
            lo, hi = ids.index(change.previous_run_id), ids.index(change.run_id)
            out.append(Step(change, conf, conf.nights[max(lo - 1, 0):hi + 2]))
    return sorted(out, key=lambda s: s.change.run_id, reverse=True)  # newest first, as recorded


def render_index(site: Site) -> str:
    template = html.environment().get_template("site_index.html.j2")
    failing = [c for c in site.configurations if c.latest.failed]
    return template.render(site=site, failing=failing, history_name=site.history.name, overview=overview(site),
                           n_steps=sum(len(c.steps) for c in site.configurations))


def render_configuration(conf: Configuration, site: Site) -> str:
    template = html.environment().get_template("site_configuration.html.j2")
    return template.render(c=conf, chart=chart(conf, site), nights=list(reversed(conf.nights)), axis=site.axis,
                           missing=[n for n in conf.nights if n.missing], threshold_pp=site.threshold_pp)


def render_regressions(site: Site) -> str:
    template = html.environment().get_template("site_regressions.html.j2")
    return template.render(site=site, steps=steps(site), threshold_pp=site.threshold_pp)


def backlinked(report: str, conf: Configuration) -> str:
    """A copied report.html with a line at its top leading back to its configuration's page (the report's own
    links stay as they are: the files beside it are copied with it)."""
    nav = (f'<nav style="font: 13px system-ui, sans-serif; margin: 8px 12px">'
           f'<a href="../../{conf.page}">&larr; {escape(conf.label)}</a> &middot; '
           f'<a href="../../index.html">all configurations</a></nav>')
    return re.sub(r"(<body[^>]*>)", lambda m: m[1] + nav, report, count=1)


def marker(site: Site, files: list[str]) -> str:
    """qual-site.json: what the site holds (the folder's mark as a site qual published, so a later publish may
    replace it) and every file it wrote (a later publish removes those and nothing else)."""
    return json.dumps({"generator": "qual history publish", "history": site.history.name, "axis": site.axis,
                       "threshold_pp": site.threshold_pp,
                       "configurations": [{"page": c.page, "label": c.label, "runs": [n.run.id for n in c.nights]}
                                          for c in site.configurations],
                       "files": sorted(files)}, indent=2) + "\n"


def _written(out_dir: Path) -> set[str] | None:
    """The files an earlier publish wrote in out_dir, from its qual-site.json (one that predates the list: its
    pages and every file under the runs it names); None where the marker cannot be read."""
    try:
        mark = read_json(out_dir / MARKER, MAX_MARKER_BYTES, "site marker", follow=False)
    except (OSError, QualError):
        return None
    if not isinstance(mark, dict):
        return None
    if isinstance(mark.get("files"), list):
        return {f for f in mark["files"] if isinstance(f, str)} | {MARKER}
    confs = mark.get("configurations") if isinstance(mark.get("configurations"), list) else []
    pages = {c.get("page") for c in confs if isinstance(c, dict)}
    runs = {f"{RUNS}/{r}/" for c in confs if isinstance(c, dict) and isinstance(c.get("runs"), list) for r in c["runs"]}
    found = set()
    for path in out_dir.rglob("*"):
        name = path.relative_to(out_dir).as_posix()
        if path.is_dir() and not path.is_symlink():
            continue
        if name in pages or name in (MARKER, "index.html") or any(name.startswith(r) for r in runs):
            found.add(name)
    return found


# ---------------------------------------------------------------- writing


def check_target(out_dir: Path) -> None:
    """DIR is new, an empty folder, or a site qual published (only that is ever replaced)."""
    check_path_name(out_dir, "DIR")
    if out_dir.is_symlink():
        raise QualError(f"{out_dir} is a link; give the folder itself")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise QualError(f"{out_dir} exists and is not a folder; give a folder for the site")
    try:
        entries = [p.name for p in out_dir.iterdir()]
    except OSError as exc:
        raise QualError(f"{out_dir}: cannot read the folder ({exc.strerror or exc})") from None
    if entries and not _regular(out_dir / MARKER):
        raise QualError(f"{out_dir} holds files and is not a site qual published (no {MARKER}); give a new or "
                        "empty folder, or the folder of an earlier publish")
    if entries:  # an earlier site: replaced whole, so it must hold nothing a publish did not write
        written = _written(out_dir)
        for path in sorted(out_dir.rglob("*")):
            name = path.relative_to(out_dir).as_posix()
            if (path.is_symlink() or not path.is_dir()) and (written is None or name not in written):
                raise QualError(f"{out_dir} holds {name}, which no publish wrote; publishing replaces the folder "
                                "whole: move it out, or give another folder")


def _copy(source: Path, target: Path, conf: Configuration) -> bool:
    """Copy one file of a run, a report with its line back to conf's page (False: it could not be read, is no regular
    file or is larger than MAX_COPIED_BYTES, and is left out)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(target.parent, exc) from None
    try:
        if target.name == REPORT:
            write_text(target, backlinked(read_text(source, MAX_REPORT_BYTES, "report"), conf))
        else:
            copy_file(source, target, MAX_COPIED_BYTES, "file of a run")
    except WriteError:
        raise
    except (OSError, QualError):
        return False
    return True


def _write_site(site: Site, root: Path) -> Site:
    """Copy each night's files into root/runs/<id>/ and write the pages; returns the site as written (a file that
    could not be read is left out of its night)."""
    configurations = []
    for conf in site.configurations:
        nights = []
        for n in conf.nights:
            copied = tuple((p, name) for p, name in n.sources if _copy(p, root / n.folder / name, conf))
            nights.append(n if copied == n.sources else replace(n, sources=copied))
        configurations.append(replace(conf, nights=tuple(nights)))
    site = replace(site, configurations=configurations)
    (root / PAGES).mkdir(exist_ok=True)
    files = [f"{n.folder}/{name}" for c in site.configurations for n in c.nights for _, name in n.sources]
    for conf in site.configurations:
        write_text(root / conf.page, render_configuration(conf, site))
        files.append(conf.page)
    write_text(root / "index.html", render_index(site))
    write_text(root / REGRESSIONS, render_regressions(site))
    write_text(root / MARKER, marker(site, [*files, "index.html", REGRESSIONS]))
    return site


def _building(out: Path) -> str:
    """The name prefix of the hidden folder beside out that a publish writes its site in."""
    return f".{out.name[:200]}.publish-"


def _replaced(out: Path) -> str:
    """The name prefix of the hidden folder beside out that holds the site being replaced (as its `site`)."""
    return f".{out.name[:200]}.old-"


def clear_abandoned(out: Path) -> None:
    """Remove what publishes killed before their end (kill -9) left beside out: a site half-written, and a site being
    replaced, moved back to out first where out is missing (it was killed between the two renames). A folder a
    running publish holds (qual.files.locked_folder) is left to it."""
    for path, lock in abandoned_folders(out.parent, _replaced(out), "publish"):
        try:
            earlier = path / "site"
            if not os.path.lexists(out) and earlier.is_dir() and not earlier.is_symlink():
                try:
                    os.replace(earlier, out)
                except OSError as exc:
                    raise WriteError(out, exc) from None
            remove_tree(path)
        finally:
            lock.release()
    for path, lock in abandoned_folders(out.parent, _building(out), "publish"):
        try:
            remove_tree(path)
        finally:
            lock.release()


def publish(history_path: str | Path, out_dir: str | Path, axis: str = "date",
            threshold_pp: float = hist.DEFAULT_STEP_PP) -> Site:
    """Build the site of a history into out_dir, its plots along axis and its step changes those of more than
    threshold_pp, replacing the site published there before."""
    hist.check_step_pp(threshold_pp)
    out = Path(os.path.abspath(out_dir))
    check_path_name(out, "DIR")
    clear_abandoned(out)
    check_target(out)
    site = build(history_path, axis, threshold_pp)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(out.parent, exc) from None
    # Held (locked) while this publish runs: a publish killed before its end leaves it unheld, and the next removes it
    tmp, lock = locked_folder(out.parent, _building(out), "publish")
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the site from a web server's user
        site = _write_site(site, tmp)
        _replace(tmp, out)
    finally:
        remove_tree(tmp)
        lock.release()
    return site


def _replace(new: Path, out: Path) -> None:
    """new takes out's name; the site there before (checked by check_target) is removed after."""
    old = moved = lock = None
    try:
        if out.exists():
            old, lock = locked_folder(out.parent, _replaced(out), "publish")
            moved = old / "site"
            os.replace(out, moved)
        os.replace(new, out)
    except OSError as exc:
        if moved is not None and moved.exists():
            try:
                os.replace(moved, out)  # the earlier site back where it was
            except OSError:
                old = None  # kept where it is rather than removed
        raise WriteError(out, exc) from None
    finally:
        if old is not None:
            remove_tree(old)
        if lock is not None:
            lock.release()
