"""`qual compare`: any two arms from earlier result files, judged like a run (e.g. engine A vs B, build N vs N+1).

A sweep's result names its arms control and its candidates' names (RESULT:candidate-dcp2-sharded)."""

from __future__ import annotations

from pathlib import Path

from qual import shown
from qual.records import ArmRunInfo, GraphCapture
from qual.errors import QualError
from qual.harness.sweep import CANDIDATE
from qual.harness.build import build_result
from qual.result import ArmResult, Result
from qual.sweep_result import SWEEP_SCHEMA, SweepResult, load_any
from qual.userfiles import check_path_name

ARM_NAMES = ("control", "candidate")
SWEEP_CANDIDATE = f"{CANDIDATE}-"  # a sweep's candidates' names begin so


def parse_ref(ref: str) -> tuple[Path, str]:
    """RESULT[:ARM] where RESULT is result.json or a run directory; ARM defaults to candidate (a sweep's: a candidate's
    name)."""
    path, sep, arm = ref.rpartition(":")
    if not sep or "/" in arm:  # no ":ARM" suffix
        path, arm = ref, "candidate"
    if arm not in ARM_NAMES and not arm.startswith(SWEEP_CANDIDATE):
        raise QualError(f"{ref}: arm must be one of {', '.join(ARM_NAMES)} or a sweep's candidate (got {arm!r})")
    check_path_name(path, "RESULT")
    p = Path(path)
    if p.is_dir():
        p = p / "result.json"
    if not p.is_file():
        raise QualError(f"{ref}: no result file at {p}")
    return p, arm


def _as_engine_output(arm: ArmResult):
    g = {k: v for k, v in arm.graph_capture.items() if k in GraphCapture.__dataclass_fields__}
    info = ArmRunInfo(arm.engine_version, GraphCapture(**g), arm.throughput.wall_seconds, arm.throughput.output_tokens,
                      arm.log_path, arm.runnable, arm.not_runnable_reason, extra=dict(arm.extra),
                      generate_seconds=arm.throughput.generate_seconds,
                      build=arm.provenance.engine if arm.provenance is not None else None)
    return arm.config, info, arm.per_request


def arm_of(loaded: Result | SweepResult, arm: str, ref: str) -> ArmResult:
    """The arm a reference names: control or candidate of a run; control or a candidate of a sweep (by name)."""
    if isinstance(loaded, SweepResult):
        if arm == "control":
            return loaded.control
        if arm not in loaded.names():
            raise QualError(f"{ref}: a sweep's result ({SWEEP_SCHEMA}) has the arms control, {', '.join(loaded.names())}: "
                            "name one (RESULT:ARM)")
        return loaded.result(arm).candidate
    if arm not in ARM_NAMES:
        raise QualError(f"{ref}: a single run's result has the arms {', '.join(ARM_NAMES)} (got {arm!r})")
    return loaded.arms[arm]


def compare(ref_a: str, ref_b: str, gate_path: str, seed: int = 0) -> Result:
    """Result with A's arm as control and B's as candidate; both must have replayed the same corpus the same way."""
    (pa, arm_a), (pb, arm_b) = parse_ref(ref_a), parse_ref(ref_b)
    ra, rb = load_any(pa), load_any(pb)
    a, b = arm_of(ra, arm_a, ref_a), arm_of(rb, arm_b, ref_b)
    if ra.corpus.fingerprint != rb.corpus.fingerprint:
        raise QualError(f"cannot compare: corpus fingerprints differ ({ra.corpus.fingerprint} vs {rb.corpus.fingerprint})")
    if a.config.get("sampling") != b.config.get("sampling"):
        raise QualError(f"cannot compare: sampling differs ({a.config.get('sampling')} vs {b.config.get('sampling')})")
    for name, arm in ((ref_a, a), (ref_b, b)):
        if not arm.runnable:
            raise QualError(f"cannot compare: {name} did not run ({arm.not_runnable_reason})")
    # Each arm keeps the provenance its own run recorded: this machine did not produce either.
    return build_result(ra.corpus, _as_engine_output(a), _as_engine_output(b), gate_path, seed,
                        reproduce=shown.command(["qual", "compare", ref_a, ref_b]), provenances=(a.provenance, b.provenance))
