"""No false alarms: the toy pair run twice, unchanged, the second night against the first as its baseline
(`--baseline history:last-pass`, the shipped nightly-baseline gate at its default thresholds), reference engine on
CPU, where greedy decoding is deterministic."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from qual.cli.main import main
from qual.paths import shipped

pytestmark = pytest.mark.slow  # engine processes and whole runs: scheduled first (tests/conftest.py)

SMALL = ["--dcp", "1", "--tp", "1", "--limit", "6", "--max-tokens", "24"]


def qual(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "qual", *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def nights(tmp_path_factory):
    root = tmp_path_factory.mktemp("nights")
    db = root / "history.sqlite"
    first = qual("run", *SMALL, "--meta", "deploy=d1", "--out", root / "night1", "--history", db)
    second = qual("run", *SMALL, "--gate", shipped("gate", "nightly-baseline"), "--baseline", "history:last-pass",
                  "--meta", "deploy=d2", "--axis", "meta:deploy", "--out", root / "night2", "--history", db)
    return root, db, first, second


def test_an_unchanged_night_passes_against_its_own_baseline(nights):
    root, _, first, second = nights
    assert first.returncode == 0, first.stdout + first.stderr
    assert second.returncode == 0, second.stdout + second.stderr
    r = json.loads((root / "night2" / "result.json").read_text())
    b = r["baseline"]
    assert (b["history_id"], b["chosen_by"]) == (1, "last pass")
    assert b["result_path"].endswith("night1/result.json")
    checks = {c["name"]: c for c in r["gate"]["checks"]}
    assert {"baseline_delta_lower_bound", "per_position_delta", "category_delta", "acceptance_floor"} <= set(checks)
    assert all(c["passed"] and not c["detail"].startswith("skipped") for c in checks.values()), checks
    for arm in ("control", "candidate"):
        a = b["arms"][arm]
        assert a["compared"] and a["n_requests"] == 6 and a["retokenized"] == []
        assert a["delta_rate"] == 0 and a["delta_rate_ci"]["0.95"] == [0, 0]
        assert a["baseline_rate"] == a["tonight_rate"] == r["arms"][arm]["acceptance"]["rate"] > 0
        assert [p["delta"] for p in a["per_position"]] == [0] * 7 and a["moved"] == []
    # the only differences between the nights are not in the arms' configs
    assert b["differs"] == []
    assert [t["run_id"] for t in b["trend"]] == [1] and b["trend"][0]["baseline"] is True
    # the strip runs along --axis, recorded with what each night holds for it, and reproduced
    assert b["axis"] == "meta:deploy" and b["trend"][0]["meta"] == {"deploy": "d1"}
    assert "--meta deploy=d2 --axis meta:deploy" in r["reproduce"]


def test_the_reports_carry_the_baseline(nights):
    root, db, _, second = nights
    out = root / "night2"
    assert "baseline run 1 (last pass): control" in second.stdout
    html = (out / "report.html").read_text()
    assert "Against the baseline" in html and "run 1 (last pass)" in html
    assert html.count("<svg") == 3 and "recorded runs of this configuration and tonight" in html  # the trend strip
    strip = html[html.index("Against the baseline"):html.index("Acceptance per draft position")]
    assert ">d1</text>" in strip and ">d2</text>" in strip and ">meta:deploy</text>" in strip  # along --axis
    md = (out / "summary.md").read_text()
    assert "### Against the baseline: run 1 (last pass)" in md and "| control | 6 |" in md
    props = {p.get("name"): p.get("value") for p in ET.parse(out / "junit.xml").iter("property")}
    assert props["baseline"] == "run 1 (last pass)" and props["baseline_delta_control_rate"] == "0.0"
    night1 = (root / "night1" / "summary.md").read_text()
    assert "Against the baseline" not in night1
    assert "baseline" not in json.loads((root / "night1" / "result.json").read_text())


def in_process(argv, capsys) -> tuple[int, str, str]:
    """The CLI in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    old = sys.argv
    sys.argv = ["qual", *map(str, argv)]
    try:
        with pytest.raises(SystemExit) as done:
            main()
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def test_a_pin_is_taken_before_the_last_pass(nights, capsys):
    root, db, _, _ = nights
    code, out, err = in_process(["history", "baseline", "pin", "1", "--history", db], capsys)
    assert code == 0 and "run 1 is now the baseline of its configuration" in out, err
    code, out, err = in_process(["run", *SMALL, "--baseline", "history:last-pass", "--dry-run", "--history", db], capsys)
    assert code == 0 and "# baseline: run 1 (pinned" in out, err
    assert in_process(["history", "baseline", "list", "--history", db], capsys)[1].startswith("run 1 pinned ")
    assert in_process(["history", "baseline", "unpin", "1", "--history", db], capsys)[0] == 0
    code, out, err = in_process(["run", *SMALL, "--baseline", "history:last-pass", "--dry-run", "--history", db], capsys)
    assert "# baseline: run 2 (last pass" in out, out + err  # night 2 passed: it is the newest pass now
    code, _, err = in_process(["history", "baseline", "unpin", "1", "--history", db], capsys)
    assert code == 2 and "run 1 is not pinned" in err
