"""Profiles and gate files are validated on load: every mistake is exit 2 with one line naming the file and the key."""

from __future__ import annotations

import sys

import pytest
import yaml

from checkpoints import make_profile
from qual.cli.main import main


def qual(argv: list[str], capsys) -> tuple[int, str]:
    """Run the CLI in this process: (exit code, stderr)."""
    old = sys.argv
    sys.argv = ["qual", *map(str, argv)]
    try:
        with pytest.raises(SystemExit) as done:
            main()
    finally:
        sys.argv = old
    return done.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = make_profile(tmp_path_factory.mktemp("prof"))
    return yaml.safe_load(path.read_text())


def _merge(data: dict, change: dict) -> dict:
    out = dict(data)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


PROFILE_CASES = [  # (change to a valid profile, words the one-line error must hold)
    ({"tp": "4"}, "tp: input should be a valid integer (got '4')"),
    ({"num_speculative_tokens": "7"}, "num_speculative_tokens: input should be a valid integer"),
    ({"max_tokens": -1}, "max_tokens: input should be greater than 0"),
    ({"dcp": 0}, "dcp: input should be greater than 0"),
    ({"dtype": "float8"}, "dtype: input should be"),
    ({"flavour": "x"}, "flavour: unknown key"),
    ({"reference": {"max_num_seqs": "8"}}, "reference.max_num_seqs: input should be a valid integer"),
    ({"reference": {"kv_memory_mib": -5}}, "reference.kv_memory_mib: input should be greater than 0"),
    ({"reference": {"block_size": 0}}, "reference.block_size: input should be greater than 0"),
    ({"reference": {"fused_decode": True}}, "reference.fused_decode: unknown key"),
    ({"reference": {"backend": "warp-speed"}}, "reference.backend: backend 'warp-speed'"),
    ({"reference": {"cuda_graph_sizes": [1, -2]}}, "reference.cuda_graph_sizes.1: input should be greater than 0"),
    ({"reference": {"prefill_ahead": -1}}, "reference.prefill_ahead: input should be greater than or equal to 0"),
    ({"vllm": {"gpu_memory_utilization": 1.5}}, "vllm.gpu_memory_utilization: input should be less than or equal to 1"),
    ({"vllm": {"cudagraph_mode": "SOMETIMES"}}, "vllm.cudagraph_mode: not one of NONE"),
    ({"vllm": {"warp": 9}}, "vllm.warp: unknown key"),
    ({"vllm": {"startup_timeout_s": float("nan")}}, "vllm.startup_timeout_s: input should be a finite number"),
    ({"engine": "warp"}, "engine: input should be 'reference', 'vllm' or 'attach' (got 'warp')"),
    ({"device": "gpu"}, "device: must be cpu, cuda or cuda:N (got 'gpu')"),
    ({"gpu_memory_gib": 0}, "gpu_memory_gib: input should be greater than 0"),
    ({"block_size": 4}, "block_size: belongs under `reference:`"),
    ({"target": "/nonexistent/checkpoint"}, "target: '/nonexistent/checkpoint' is not a checkpoint directory"),
    ({"draft": "no/such/draft"}, "draft: 'no/such/draft' is not a checkpoint directory"),
]


@pytest.mark.parametrize("change,words", PROFILE_CASES, ids=[w.split(":")[0] for _, w in PROFILE_CASES])
def test_bad_profiles_exit_2_naming_file_and_key(change, words, base, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_merge(base, change)))
    code, err = qual(["run", "--model", path, "--out", tmp_path / "out", "--history", tmp_path / "h.sqlite"], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and words in lines[0], err
    assert not (tmp_path / "out").exists() and not (tmp_path / "h.sqlite").exists()


def test_a_missing_profile_file_names_the_profiles_there_are(tmp_path, capsys):
    code, err = qual(["run", "--model", "no-such-model", "--dry-run"], capsys)
    assert code == 2 and "unknown model 'no-such-model'; available:" in err and "toy" in err


GATE_CASES = [  # (gate file text, words the error must hold)
    ("rules:\n  - {check: acceptance_delta_lower_bound, min_pp: .nan}\n", "min_pp must be a number of percentage points, got nan"),
    ("rules:\n  - {check: acceptance_delta_lower_bound, min_pp: .inf}\n", "min_pp must be a number of percentage points, got inf"),
    ("rules:\n  - {check: acceptance_delta_lower_bound, min_pp: -.inf}\n", "got -inf"),
    ("rules:\n  - {check: acceptance_delta_lower_bound, min_pp: -0.5, confidence: 1.5}\n", "confidence must be a number in (0, 1)"),
    ("rules:\n  - {check: mean_acceptance_length_ratio, min: '0.9'}\n", "min must be a positive number, got '0.9'"),
    ("rules:\n  - {check: acceptance_delta_lower_bound}\n", "missing parameter 'min_pp'"),
    ("rules:\n  - {check: acceptance_delta_lower_bound, min_pp: 0, typo: 1}\n", "unknown parameter(s) ['typo']"),
    ("rules:\n  - {check: vibes}\n", "unknown check 'vibes'"),
    ("rulez: []\n", "unknown top-level keys ['rulez']"),
    ("rules: [\n", "invalid YAML"),
]


@pytest.mark.parametrize("text,words", GATE_CASES, ids=[f"gate{i}" for i in range(len(GATE_CASES))])
def test_bad_gate_files_exit_2_naming_file_and_key(text, words, tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    gate.write_text(text)
    code, err = qual(["run", "--gate", gate, "--dry-run"], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(gate) in lines[0] and words in lines[0], err


def test_a_yaml_alias_bomb_is_refused_quickly_and_briefly(tmp_path, capsys):
    """Anchors nest nine deep: printing the rule whole would take minutes and all memory; it is shown truncated."""
    lines = ["description:", "  d0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"  d{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    lines.append("rules: *a9")
    gate = tmp_path / "bomb.yaml"
    gate.write_text("\n".join(lines) + "\n")
    code, err = qual(["run", "--gate", gate, "--dry-run"], capsys)
    assert code == 2 and len(err) < 600, err[:600]


def test_an_oversized_config_file_is_refused_before_parsing(tmp_path, capsys):
    gate = tmp_path / "huge.yaml"
    gate.write_text("# " + "x" * (1 << 20) + "\nrules: []\n")
    code, err = qual(["run", "--gate", gate, "--dry-run"], capsys)
    assert code == 2 and "larger than a config file may be" in err
