"""summary.md: verdict, headline numbers and gate checks for a CI step summary (GitHub-flavoured Markdown)."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

from qual.report import baseline as bview
from qual.report import latency as lview
from qual.report import common, matrix, provenance
from qual.files import write_text
from qual.outcomes import FAIL, INCONCLUSIVE, PASS, SKIPPED
from qual.shown import safe
from qual.result import DECIDED_NOTHING, FIRST_NIGHT, Result
from qual.sweep_result import SweepResult


def cell(text: object) -> str:
    """Make untrusted text inert inside a Markdown table cell (GitHub renders inline HTML; a terminal that shows the
    file acts on escape sequences: control characters are written as their escapes)."""
    s = html.escape(safe(re.sub(r"[\r\n]+", " ", str(text))), quote=False)
    return s.replace("|", "\\|").replace("`", "\\`")


def code(text: object, in_table: bool = False) -> str:
    """Untrusted text as an inline code span that renders as written whatever it holds (CommonMark: inside a span
    nothing is markup, so nothing is escaped but what GitHub reads before spans): the span is opened and closed by a
    run of backticks longer than any inside, with a space inside each end where the text starts or ends with a
    backtick or a space (the renderer strips one from each end). In a table cell `|` is escaped: GFM splits a row
    into cells before it reads spans, and unescapes `\\|` inside them."""
    s = safe(re.sub(r"[\r\n]+", " ", str(text))) or " "
    if in_table:
        s = s.replace("|", "\\|")
    ticks = "`" * (_longest_backticks(s) + 1)
    pad = " " if s.strip(" ") and (s[0] in "` " or s[-1] in "` ") else ""  # all spaces: never stripped
    return f"{ticks}{pad}{s}{pad}{ticks}"


def _longest_backticks(text: str) -> int:
    return max((len(m) for m in re.findall(r"`+", text)), default=0)


def _fence(text: str) -> str:
    return "`" * max(3, _longest_backticks(text) + 1)


# The verdict's heading by the gate's outcome
HEADINGS = {PASS: "✅ PASS", FAIL: "❌ FAIL", INCONCLUSIVE: "⚠️ INCONCLUSIVE"}
# A check's mark by its outcome
MARKS = {PASS: "✅", FAIL: "❌", INCONCLUSIVE: "⚠️", SKIPPED: "⏭️"}


def render(result: Result, folder: str | Path | None = None, history: str | Path | None = None) -> str:
    """The summary as Markdown text; folder (the run's) and history (its database) name the night in the command
    that pins it."""
    n_pass = sum(c.passed for c in result.gate.checks)
    c_dcp, k_dcp = result.control.config.get("dcp"), result.candidate.config.get("dcp")
    note = common.inconclusive_note(result.gate)
    lines = [
        f"## {HEADINGS[result.gate.outcome]}: qual {cell(common.title(result))}",
        "",
        f"{n_pass}/{len(result.gate.checks)} gate checks passed on {common.replayed(result)} "
        f"of {code(result.corpus.name)}.",
        "",
        *_interval_note(common.interval_note(result)),
        *([f"⚠️ {cell(note)}.", ""] if note else []),
        *([f"{cell(FIRST_NIGHT[0].upper() + FIRST_NIGHT[1:])}.", ""] if result.first_night else []),
        *([f"Changed since the baseline ({cell(result.baseline.label)}): {cell('; '.join(result.baseline.changed))}.",
           ""] if result.baseline is not None and result.baseline.changed else []),
        *_meta(result.meta),
        *_headline(result, c_dcp, k_dcp),
        *_speedup(result),
        "", "### Gate checks", "", *_checks(result),
    ]
    lines += _latency(result)
    if result.baseline is not None:
        lines += _baseline(result, folder, history)
    cats = [r for r in result.comparison.per_category if r.get("delta") is not None]
    if len(cats) > 1:
        cats.sort(key=lambda r: (r["delta"], r["category"]))
        lines += ["", "### Per category (worst first)", "", "| category | requests | control | candidate | Δ |", "|---|---:|---:|---:|---:|"]
        lines += [
            f"| {cell(r['category'])} | {r['n']} | {common.pct(r['control_rate'])} | "
            f"{common.pct(r['candidate_rate'])} | {common.pp(r['delta'])} |"
            for r in cats[:10]
        ]
    if result.comparison.per_turn:
        lines += ["", "### Per turn", "", "| turn | requests | control | candidate | Δ | earlier turns differ |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {t['turn']} | {t['n']} | {common.pct(t['control_rate'])} | {common.pct(t['candidate_rate'])} | "
                  f"{common.pp(t['delta'])} | {t['earlier_turns_differ']} |" for t in result.comparison.per_turn]
    if result.warnings:
        lines += ["", "### ⚠️ The arms' provenance differs", ""] + [f"- {cell(w)}" for w in result.warnings]
    lines += ["", "### Engines and provenance", "", "| | control | candidate |", "|---|---|---|"]
    lines += [f"| {cell(f.label)} | {cell(f.control)} | {cell(f.candidate)} |" for f in provenance.engine_facts(result)]
    lines += ["", f"Corpus fingerprint: {code(result.corpus.fingerprint)}", ""]
    if result.reproduce:
        fence = _fence(result.reproduce)
        lines += ["Reproduce:", "", f"{fence}sh", safe(result.reproduce), fence, ""]
    return "\n".join(lines)


def _interval_note(note: str | None) -> list[str]:
    return [f"⚠️ {cell(note)}.", ""] if note is not None else []


def _headline(result: Result, c_dcp, k_dcp) -> list[str]:
    return [f"| | control (DCP {cell(c_dcp)}) | candidate (DCP {cell(k_dcp)}) | candidate − control |", "|---|---:|---:|---|",
            *(f"| {cell(h.label)} | {cell(h.control)} | {cell(h.candidate)} | {cell(h.delta)} |"
              for h in common.headline(result))]


def _meta(meta: dict[str, str]) -> list[str]:
    """The night's --meta labels, one line."""
    return [", ".join(f"{cell(k)}: {code(v)}" for k, v in meta.items()), ""] if meta else []


def _checks(result: Result) -> list[str]:
    return ["| | check | detail |", "|---|---|---|",
            *(f"| {MARKS[c.outcome]} | {cell(c.name)} | {cell(c.detail)} |" for c in result.gate.checks),
            *([f"| ❌ | | {DECIDED_NOTHING} |"] if result.gate.decided_nothing else [])]


def render_sweep(sweep: SweepResult) -> str:
    """A sweep's summary: the matrix, then each candidate's headline and gate checks."""
    rows = matrix.rows(sweep)
    lines = [f"## {HEADINGS['pass' if sweep.passed else 'fail']}: qual {cell(matrix.title(sweep))}", "",
             f"{sum(r.passed for r in rows)}/{len(rows)} candidates passed their gate on {sweep.corpus.count} requests "
             f"of {code(sweep.corpus.name)}; {cell(matrix.control_line(sweep))}.", "",
             *_interval_note(matrix.interval_note(sweep))]
    lines += [f"⚠️ {cell(n)}." for n in sweep.notes] + ([""] if sweep.notes else [])
    lines += ["| candidate | settings | acceptance | Δ vs control (95% CI) | mean acceptance length ratio | "
              "target outputs identical | graph sizes | verdict |", "|---|---|---:|---|---:|---|---|---|"]
    lines += [f"| {code(r.name, in_table=True)} | {cell(r.settings)} | {r.rate} | {r.delta} {r.ci} | {r.mal_ratio} | "
              f"{cell(r.identical)} | {cell(r.graphs)} | "
              f"{MARKS[r.outcome]} {r.verdict}{': ' + cell(', '.join(r.failed)) if r.failed else ''} |"
              for r in rows]
    for name, result in sweep.results():
        lines += ["", f"### {HEADINGS[result.gate.outcome]} {code(name)}: {cell(common.title(result))}", "",
                  *_headline(result, result.control.config.get("dcp"), result.candidate.config.get("dcp")), "",
                  *_checks(result)]
        lines += ["", *(f"- ⚠️ {cell(w)}" for w in result.warnings)] if result.warnings else []
    lines += ["", f"Corpus fingerprint: {code(sweep.corpus.fingerprint)}", ""]
    if sweep.reproduce:
        fence = _fence(sweep.reproduce)
        lines += ["Reproduce:", "", f"{fence}sh", safe(sweep.reproduce), fence, ""]
    return "\n".join(lines)


def _latency(result: Result) -> list[str]:
    rows = lview.latency_rows(result)
    if not rows:
        return []
    names = list(lview.arms(result))
    lines = ["", "### Latency", "", "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines += [f"| {cell(r.label)} | " + " | ".join(cell(r.cells[n]) for n in names) + " |" for r in rows]
    if lview.on_cpu(result):
        lines += ["", f"⚠️ {cell(lview.CPU_NOTE[0].upper() + lview.CPU_NOTE[1:])}."]
    return lines


def _speedup(result: Result) -> list[str]:
    """`--speedup`'s sentences under the headline: the per-request ratio, the batch's, whether they disagree."""
    lines = lview.speedup_lines(result)
    return ["", *(f"- {'⚠️ ' if line.startswith('the two disagree') else ''}{cell(line[0].upper() + line[1:])}."
                  for line in lines)] if lines else []


def _baseline(result: Result, folder: str | Path | None, history: str | Path | None) -> list[str]:
    b = result.baseline
    lines = ["", f"### Against the baseline: {cell(b.label)}", "",
             f"{code(b.result_path)} ({cell(b.chosen_by)}, created {cell(b.created_at)}). "
             f"Differs: {cell('; '.join(bview.differs(b, limit=6)) or 'nothing but the time it ran')}.", "",
             *_forced(b, folder, history),
             *([f"{cell(bview.selection(b))}.", ""] if bview.selection(b) else []),
             "| arm | requests | baseline | tonight | Δ (95% CI) | mean acceptance length |", "|---|---:|---:|---:|---|---|"]
    for a in bview.arm_rows(b):
        if not a.compared:
            lines.append(f"| {a.arm} | | | | not compared: {cell(a.reason)} | |")
            continue
        lines.append(f"| {a.arm} | {a.n} | {a.baseline_rate} | {a.tonight_rate} | {a.delta_rate} {a.ci95} | "
                     f"{a.baseline_mal} → {a.tonight_mal} ({a.delta_mal}) |")
    arms, positions = bview.position_rows(b)
    if positions:
        lines += ["", "| position | " + " | ".join(f"{arm}: baseline → tonight (Δ)" for arm in arms) + " |",
                  "|---:|" + "---|" * len(arms)]
        lines += [f"| {p.position} | " + " | ".join(f"{c[0]} → {c[1]} ({'**' + c[2] + '**' if c[4] else c[2]})"
                                                    for c in p.cells) + " |" for p in positions]
    moved = bview.moved(b, 5)
    if moved:
        lines += ["", "Moved most: " + ", ".join(f"{code(m['id'])} ({m['arm']}) {common.pct(m['baseline_rate'])} → "
                                                  f"{common.pct(m['tonight_rate'])}" for m in moved) + "."]
    trend = bview.trend_points(result)[-10:]
    if len(trend) > 1:
        strip = " → ".join(f"{common.pct(p[2], 1)}{' (baseline)' if p[3] else ''}" for p in trend)
        lines += ["", f"Candidate over the last {len(trend) - 1} runs of this configuration and tonight: {strip}."]
    return lines


def _forced(b, folder: str | Path | None, history: str | Path | None) -> list[str]:
    """Where the baseline is of another configuration: what differs, and the command that pins this night."""
    line = bview.forced(b)
    if line is None:
        return []
    pin = bview.pin_command(b, folder, history)
    return [f"⚠️ {cell(line)}" + (f"; {cell(bview.PIN_HINT)}: {code(pin)}" if pin else "") + ".", ""]


@dataclass(frozen=True)
class ErrorSummary:
    """A run that ended without a verdict, as summary.md tells it."""

    title: str  # "toy: DCP 1 -> DCP 4 (reference, TP 4, draft KV replicated)"
    exit_code: int
    what: str  # "engine failure", "internal error", "usage, configuration or input error", "interrupted"
    cause: str  # the line stderr showed
    command: str  # the `qual run` that reproduces it
    resume: str  # the command that finishes it


def render_error(e: ErrorSummary) -> str:
    """summary.md of a run that ended in exit 2, 3, 4 or 130 after its output folder existed: why, and what next."""
    fence = _fence(f"{e.command}\n{e.resume}")  # both shell-quoted (qual.shown.command)
    return "\n".join([
        f"## ⛔ ERROR: qual {cell(e.title)}", "",
        f"The run ended without a verdict: exit {e.exit_code} ({cell(e.what)}).", "",
        f"> {cell(e.cause)}", "",
        "Recorded in the run history as an error night (never read as a baseline). Requests that finished are kept "
        "in this folder's journals; finish the run with:", "",
        f"{fence}sh", e.resume, fence, "",
        "Reproduce:", "", f"{fence}sh", e.command, fence, "",
    ])


def write_error(summary: ErrorSummary, path: str | Path) -> Path:
    return write_text(path, render_error(summary))


def write(result: Result | SweepResult, path: str | Path, history: str | Path | None = None) -> Path:
    """summary.md at path, in the run's folder; history: the database the run is recorded in (None: not recorded)."""
    if isinstance(result, SweepResult):
        return write_text(path, render_sweep(result))
    return write_text(path, render(result, Path(path).parent, history))
