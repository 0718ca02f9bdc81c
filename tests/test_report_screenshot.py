"""A report.html as a reader sees it: rendered by headless Chromium at 1000 px, saved as a PNG; and laid out at
1,400 and 390 px, measured to fit the screen.

README.md shows docs/images/report.png. The test writes it only when QUAL_WRITE_README_SCREENSHOT=1, from a real
run of the toy pair (`qual run --dcp 4 --limit 8`, the command whose verdict README.md quotes):

    QUAL_WRITE_README_SCREENSHOT=1 .venv/bin/python -m pytest -q tests/test_report_screenshot.py

Otherwise it screenshots the reports of a synthetic result (no engine runs) into its temporary folder, so an
ordinary test run costs one Chromium start and leaves the tree as it is.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from devtools import Browser
from qual.report import write_reports
from synthetic import as_baseline, synthetic_pair, synthetic_result

REPO = Path(__file__).resolve().parents[1]
README_IMAGE = REPO / "docs" / "images" / "report.png"
WIDTH, HEIGHT = 1000, 1100  # the first screen: verdict, headline and gate checks
MAX_BYTES = 300_000
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(page: Path, profile: Path, size: tuple[int, int], *what: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
           f"--user-data-dir={profile}", *what, f"--window-size={size[0]},{size[1]}", page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def screenshot(page: Path, png: Path, profile: Path, size: tuple[int, int] = (WIDTH, HEIGHT)) -> None:
    """page (an HTML file) rendered by headless Chromium in a window of size (width, height), saved as png."""
    run = _chromium(page, profile, size, f"--screenshot={png}")
    assert run.returncode == 0 and png.exists(), run.stderr[-2000:]


def png_size(png: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def real_run_report(out: Path) -> Path:
    """report.html of `qual run --dcp 4 --limit 8` on the toy pair (CPU)."""
    cmd = [sys.executable, "-m", "qual", "run", "--dcp", "4", "--limit", "8", "--out", str(out),
           "--history", str(out.parent / "history.sqlite")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return out / "report.html"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_report_screenshot(tmp_path):
    write = os.environ.get("QUAL_WRITE_README_SCREENSHOT") == "1"
    if write:
        page = real_run_report(tmp_path / "run")
    else:
        page = write_reports(synthetic_result(40), tmp_path / "run")["html"]
    png = tmp_path / "report.png"
    screenshot(page, png, tmp_path / "chromium-profile")
    assert png_size(png) == (WIDTH, HEIGHT)
    assert 10_000 < png.stat().st_size < MAX_BYTES  # a page was drawn, and small enough to commit
    if write:
        README_IMAGE.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, README_IMAGE)


# ---------------------------------------------------------------- layout at a desktop's and a phone's width

VIEWPORTS = {"desktop": (1400, 900), "phone": (390, 844)}

# Run in the page: opens every <details>, then measures the page against the window. An element inside a box that
# scrolls (or clips) horizontally is that box's business, not the page's: the box itself is measured.
MEASURE = """(() => {
  document.querySelectorAll("details").forEach(d => { d.open = true; });
  const view = document.documentElement.clientWidth;
  const boxed = el => {
    for (let p = el.parentElement; p && p !== document.body; p = p.parentElement)
      if (getComputedStyle(p).overflowX !== "visible") return true;
    return false;
  };
  const name = el => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
    + (typeof el.className === "string" && el.className ? "." + el.className.trim().split(/ +/).join(".") : "");
  const wide = [], spills = [];
  for (const el of document.body.querySelectorAll("*")) {
    if (boxed(el)) continue;
    const r = el.getBoundingClientRect();
    if (r.width && (r.right > view + 0.5 || r.left < -0.5))
      wide.push(name(el) + " " + Math.round(r.left) + ".." + Math.round(r.right));
  }
  // Text wider than its own cell runs over the next one (what clipped the candidate column).
  for (const el of document.querySelectorAll("td, th, dd, dt, li, p, h1, h2, figcaption, summary"))
    if (getComputedStyle(el).overflowX === "visible" && el.scrollWidth > el.clientWidth + 1)
      spills.push(name(el) + " " + el.textContent.trim().slice(0, 60));
  const head = document.getElementById("headline"), box = head.parentElement;
  const headline = {right: head.getBoundingClientRect().right,
                    first_row_bottom: head.rows[1].getBoundingClientRect().bottom,
                    scrolls: box.scrollWidth > box.clientWidth};
  const scrolling = [...document.querySelectorAll(".scroll")].filter(b => b.scrollWidth > b.clientWidth);
  return {innerWidth: window.innerWidth, clientWidth: view, scrollWidth: document.documentElement.scrollWidth,
          wide: wide, spills: spills, headline: headline, scrolling_boxes: scrolling.length};
})()"""


def long_text_run(out: Path) -> Path:
    """The reports of a run holding what overflowed the page: request ids, categories and paths without a space, a
    runtime config block, full hashes, a baseline section; journals, logs and run.json beside them."""
    control, candidate = synthetic_pair(24, 0.75, 0.7, categories=("humaneval-python-" * 4, "chat"))
    ids = {r.id: f"{r.id}/" + "a-request-id-without-any-space-" * 3 for r in control}
    control, candidate = ([replace(r, id=ids[r.id]) for r in arm] for arm in (control, candidate))
    base = synthetic_result(pair=(control, control), n_resamples=200, corpus_name="corpus/" + "long-name-" * 8)
    out.mkdir(parents=True)
    res = synthetic_result(pair=(control, candidate), n_resamples=200, corpus_name=base.corpus.name,
                           baseline=as_baseline(base, out.parent / "baseline" / "result.json", history_id=7))
    config = {"async_decode": True, "cache": {"block_size": 16, "memory_bytes": 268435456}, "parallel": {"dcp": 4},
              "target_path": "/" + "very-long-directory-name/" * 8 + "target", "draft_path": "/models/" + "d" * 150}
    for name, arm in res.arms.items():
        arm.provenance.engine.runtime_config = config
        arm.provenance.gate_sha256 = "sha256:" + "9f" * 32
        arm.provenance.engine.commit = "e" * 40
        arm.log_path = str(out / f"{name}.vllm.log")
        (out / f"{name}.vllm.log").write_text("log\n")
        (out / f"{name}.requests.jsonl").write_text("{}\n")
    (out / "run.json").write_text("{}\n")
    return write_reports(res, out)["html"]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_report_fits_a_desktop_and_a_phone(tmp_path):
    """At 1,400 and 390 px no element reaches past the window (wide tables scroll inside their own box), no text
    runs out of its cell, and at 390 px the headline table is on the first screen, whole. Measured and captured in
    one layout per width (tests/devtools.py says why not with --dump-dom)."""
    page = long_text_run(tmp_path / "run")
    with Browser(CHROMIUM, tmp_path / "chromium-profile") as browser:
        for name, size in VIEWPORTS.items():
            tab = browser.open(page.as_uri(), *size)
            png = tab.screenshot(tmp_path / f"report-{size[0]}px.png")
            print(f"\n{name} screenshot, first screen ({size[0]} x {size[1]}): {png}")
            assert png_size(png) == size and png.stat().st_size > 10_000
            layout = tab.evaluate(MEASURE)
            print(f"{name} screenshot, whole page, every <details> open: "
                  f"{tab.screenshot(tmp_path / f'report-{size[0]}px-whole.png', full_page=True)}")
            assert layout["innerWidth"] == layout["clientWidth"] == size[0], layout  # laid out at the size asked for
            assert layout["scrollWidth"] <= size[0], layout
            assert layout["wide"] == [], layout["wide"][:10]
            assert layout["spills"] == [], layout["spills"][:10]
            if name == "phone":
                assert not layout["headline"]["scrolls"], layout["headline"]
                # its numbers on the first screen: the headline fits the width, and its first row the height (a
                # failing run lists its failing checks above it)
                head = layout["headline"]
                assert head["right"] <= size[0] and head["first_row_bottom"] <= size[1], layout
                assert layout["scrolling_boxes"] > 0  # the wide tables scroll in their boxes instead of the page
