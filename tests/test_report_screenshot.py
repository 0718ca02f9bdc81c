"""A report.html as a reader sees it: rendered by headless Chromium at 1000 px, saved as a PNG.

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
from pathlib import Path

import pytest

from qual.report import write_reports
from synthetic import synthetic_result

REPO = Path(__file__).resolve().parents[1]
README_IMAGE = REPO / "docs" / "images" / "report.png"
WIDTH, HEIGHT = 1000, 1100  # the first screen: verdict, headline and gate checks
MAX_BYTES = 300_000
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(page: Path, png: Path, profile: Path) -> None:
    """page (an HTML file) rendered by headless Chromium in a WIDTH x HEIGHT window, saved as png."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
           f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size={WIDTH},{HEIGHT}", page.as_uri()]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
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
