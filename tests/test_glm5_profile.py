"""The seed's profile (glm-5.3-flash names hub ids, served by vLLM on GPUs) pointed at checkpoints on disk with
--target / --draft and run by the embedded runtime on the CPU (--engine, --device win over the profile): the plan runs
them, and result.json and the reproduce command record the directories that ran."""

import json
import subprocess
import sys

import pytest

from checkpoints import make_draft
from qual import paths

pytestmark = pytest.mark.slow  # whole runs: scheduled first (tests/conftest.py)

TOY = paths.DATA_DIR / "models" / "glm-toy"


@pytest.fixture(scope="module")
def draft16(tmp_path_factory):
    """A random drafter with the profile's block (16: K = 15) on the GLM toy target's width."""
    return make_draft(tmp_path_factory.mktemp("glm-draft") / "draft", vocab_size=4096, hidden_size=128,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=384,
                      target_layer_ids=(1, 2), block_size=16)


def test_the_glm_profile_runs_local_checkpoints(draft16, tmp_path):
    target = TOY / "target"
    # the profile asks for 32768 positions; the toy target was built for 2048: refused as vLLM refuses it, by name
    refused = subprocess.run([sys.executable, "-m", "qual", "run", "--model", "glm-5.3-flash", "--target", str(target),
                              "--draft", str(draft16), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "max_model_len: 32768 is more positions than the target was built for" \
        in refused.stderr, refused.stderr
    # the same profile with max_model_len within the toy's 2048, as a team edits its copy
    profile = tmp_path / "glm-5.3-flash.yaml"
    text = paths.find("profile", "glm-5.3-flash").path.read_text()
    assert "max_model_len: 32768\n" in text
    profile.write_text(text.replace("max_model_len: 32768\n", "max_model_len: 2048\n"))
    # the profile runs on vLLM on cuda; flags win over it: the embedded runtime on the CPU here
    args = [sys.executable, "-m", "qual", "run", "--model", str(profile), "--engine", "reference", "--device", "cpu",
            "--target", str(target), "--draft", str(draft16), "--limit", "2", "--max-tokens", "4", "--dtype", "float32",
            "--out", str(tmp_path / "run"), "--history", str(tmp_path / "h.sqlite")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr  # a random drafter may fail the gate; the run itself completes
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    for arm in ("control", "candidate"):
        config = result["arms"][arm]["config"]
        assert (config["target_path"], config["draft_path"]) == (str(target.resolve()), str(draft16.resolve()))
        assert (config["tp"], config["num_speculative_tokens"]) == (4, 15)
    assert f"--target {target.resolve()} --draft {draft16.resolve()}" in result["reproduce"]


def test_a_target_that_is_not_a_checkpoint_is_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "qual", "run", "--model", "glm-5.3-flash", "--target", str(tmp_path),
                           "--dry-run"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and f"--target {tmp_path}: not a checkpoint directory" in proc.stderr
