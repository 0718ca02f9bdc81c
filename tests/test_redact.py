"""Secret env values of a profile (`vllm.env`) reach the server and no file qual writes (qual.redact); a real vLLM
run that greps every file it wrote is in test_vllm_run.py."""

from __future__ import annotations

import sys

from qual.records import ArmConfig, Sampling
from qual.redact import REDACTED, is_secret, redact_env

SECRET = "secret123"


def test_secret_looking_names_are_redacted_and_no_others():
    assert [n for n in ("HF_TOKEN", "openai_api_key", "DB_PASSWORD", "MY_SECRET", "Hf_Token_2", "VLLM_CPU_KVCACHE_SPACE",
                        "OMP_NUM_THREADS", "HF_HUB_OFFLINE") if is_secret(n)] == ["HF_TOKEN", "openai_api_key",
                                                                                   "DB_PASSWORD", "MY_SECRET", "Hf_Token_2"]
    assert redact_env({"HF_TOKEN": SECRET, "OMP_NUM_THREADS": "2"}) == {"HF_TOKEN": REDACTED, "OMP_NUM_THREADS": "2"}


def test_the_arm_record_is_redacted_and_the_server_env_is_not():
    from qual.engines.vllm.engine import VllmEngine

    arm = ArmConfig(engine="vllm", model="m", dcp=1, tp=1, draft_kv="replicated", target_path="/t", draft_path=None,
                    num_speculative_tokens=1, sampling=Sampling(), extra={"max_model_len": 64, "vllm": {
                        "env": {"HF_TOKEN": SECRET, "OMP_NUM_THREADS": "1"}, "python": sys.executable}})
    assert arm.to_json()["extra"]["vllm"]["env"] == {"HF_TOKEN": REDACTED, "OMP_NUM_THREADS": "1"}
    assert arm.extra["vllm"]["env"]["HF_TOKEN"] == SECRET  # the record in memory keeps it for the server
    command = VllmEngine(".", python=sys.executable).command(arm)
    assert command.env["HF_TOKEN"] == SECRET and SECRET not in command.shell()
    assert f"HF_TOKEN={REDACTED}" in command.shell().replace("'", "")
