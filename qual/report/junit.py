"""junit.xml: one test case per gate check, a <failure> carrying the detail when it failed; or, for a run that ended
in an engine failure (exit 3) or an internal error (exit 4), one test case whose <error> names the cause."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

from qual.files import write_text
from qual.redact import redact_text
from qual.gate import BASELINE_CHECKS
from qual.result import DECIDED_NOTHING, Result
from qual.sweep_result import SweepResult

# Characters XML 1.0 cannot carry even escaped; drop them rather than emit an unparsable file.
_INVALID_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _x(text: object) -> str:
    return _INVALID_XML.sub("\ufffd", str(text))


def gate_suite(model: object, dcp: object) -> str:
    """The test suite's name: one per model and candidate DCP size, whatever the run's outcome."""
    return f"qual.gate.{model}.dcp{dcp}"


def sweep_suite(model: object, candidate: str) -> str:
    """A sweep's test suite of one candidate: qual.gate.<model>.dcp2-sharded for candidate-dcp2-sharded."""
    return f"qual.gate.{model}.{candidate.removeprefix('candidate-')}"


def _failures(result: Result) -> int:
    """Failed checks (inconclusive ones too, unless the gate passes on them), and the gate's own failure where every
    check was skipped (its test case below)."""
    counted = result.gate.failed if result.gate.inconclusive == "pass" else result.gate.not_passed
    return len(counted) + result.gate.decided_nothing


def _cases(result: Result) -> int:
    return len(result.gate.checks) + result.gate.decided_nothing


def render(result: Result) -> str:
    """The JUnit XML document as text."""
    cfg = result.candidate.config
    root = ET.Element("testsuites", name="qual", tests=str(_cases(result)), failures=str(_failures(result)),
                      errors="0")
    _suite(root, result, gate_suite(cfg.get("model", "model"), cfg.get("dcp", "?")))
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def render_sweep(sweep: SweepResult) -> str:
    """A sweep's JUnit XML: one test suite per candidate, one test case per gate check of its comparison."""
    results = sweep.results()
    root = ET.Element("testsuites", name="qual", tests=str(sum(_cases(r) for _, r in results)),
                      failures=str(sum(_failures(r) for _, r in results)), errors="0")
    for name, result in results:
        _suite(root, result, sweep_suite(result.candidate.config.get("model", "model"), name))
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _suite(root: ET.Element, result: Result, suite_name: str) -> None:
    """One test suite: a test case per gate check of one comparison."""
    checks = result.gate.checks
    failures = _failures(result)
    skipped = sum(c.skipped or (c.inconclusive and result.gate.inconclusive == "pass") for c in checks)
    suite = ET.SubElement(
        root, "testsuite", name=_x(suite_name), tests=str(_cases(result)), failures=str(failures),
        errors="0", skipped=str(skipped), timestamp=_x(result.created_at), time="0",
    )
    props = ET.SubElement(suite, "properties")
    for name, value in (
        ("corpus", result.corpus.name),
        ("corpus_fingerprint", result.corpus.fingerprint),
        ("control_rate", result.control.acceptance.rate),
        ("candidate_rate", result.candidate.acceptance.rate),
        ("delta_rate", result.comparison.delta_rate),
        ("reproduce", result.reproduce),
        ("outcome", result.gate.outcome),
        *_baseline_properties(result),
        *((f"meta.{k}", v) for k, v in result.meta.items()),
    ):
        ET.SubElement(props, "property", name=name, value=_x("" if value is None else value))
    changed = result.baseline.changed if result.baseline is not None else []
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=_x(suite_name), name=_x(c.name), time="0")
        # a baseline check's message names what changed since the baseline (an engine upgrade, say)
        detail = c.detail + (f"; changed since the baseline: {'; '.join(changed)}"
                             if changed and c.name in BASELINE_CHECKS else "")
        if c.skipped:
            ET.SubElement(case, "skipped", message=_x(c.detail))
        elif c.inconclusive and result.gate.inconclusive == "pass":  # the gate passes on it: not a failure
            ET.SubElement(case, "skipped", message=_x(f"inconclusive: {detail}"))
        elif c.inconclusive:
            text = f"inconclusive: {detail}"
            ET.SubElement(case, "failure", message=_x(text), type="GateCheckInconclusive").text = _x(text)
        elif c.passed:
            ET.SubElement(case, "system-out").text = _x(detail)
        else:
            failure = ET.SubElement(case, "failure", message=_x(detail), type="GateCheckFailed")
            failure.text = _x(detail)
    if result.gate.decided_nothing:  # the verdict is FAIL: a CI reading failures="0" would take it for a pass
        case = ET.SubElement(suite, "testcase", classname=_x(suite_name), name="gate", time="0")
        ET.SubElement(case, "failure", message=DECIDED_NOTHING, type="GateDecidedNothing").text = DECIDED_NOTHING


def render_error(suite_name: str, case: str, message: str, error_type: str, timestamp: str) -> str:
    """The JUnit XML document of a run that ended without a verdict: one test case in error, its message the cause
    on one line, secret shapes redacted (the same text as stderr's line)."""
    line = redact_text(" ".join(message.split()))
    root = ET.Element("testsuites", name="qual", tests="1", failures="0", errors="1")
    suite = ET.SubElement(root, "testsuite", name=_x(suite_name), tests="1", failures="0", errors="1", skipped="0",
                          timestamp=_x(timestamp), time="0")
    case_el = ET.SubElement(suite, "testcase", classname=_x(suite_name), name=_x(case), time="0")
    ET.SubElement(case_el, "error", message=_x(line), type=_x(error_type)).text = _x(line)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _baseline_properties(result: Result) -> list[tuple[str, object]]:
    b = result.baseline
    if b is None:
        return []
    props: list[tuple[str, object]] = [("baseline", b.label), ("baseline_result", b.result_path),
                                       ("changed_since_baseline", "; ".join(b.changed))]
    for arm, a in b.arms.items():
        if a.compared:
            props += [(f"baseline_{arm}_rate", a.baseline_rate), (f"baseline_delta_{arm}_rate", a.delta_rate)]
    return props


def write(result: Result | SweepResult, path: str | Path) -> Path:
    return write_text(path, render_sweep(result) if isinstance(result, SweepResult) else render(result))


def write_error(path: str | Path, suite_name: str, case: str, message: str, error_type: str) -> Path:
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return write_text(path, render_error(suite_name, case, message, error_type, now))
