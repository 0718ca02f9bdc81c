"""The one interface `qual run` drives an engine through: options, preflight, describe, run."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel

from qual.errors import QualError
from qual.inventory import GIB, Inventory, MemoryNeed, gpu_shortfall
from qual.records import ArmConfig, ArmRunInfo, EngineRequest, OnResult

# Knobs an arm can ask for; each engine declares the ones it applies (Engine.honours).
KNOBS = ("dcp", "tp", "interleave", "draft_kv", "dtype", "device", "temperature", "seed", "dsa_topk", "numerics")


def refuse_numerics(arm: ArmConfig, engine: str) -> None:
    """A served vLLM computes as its build's kernels do: an arm asking for numerics (--numerics or the profile's
    `numerics:`) is refused by an engine that drives one; the embedded runtime is what models vLLM's numerics."""
    if arm.numerics is not None:
        raise QualError(f"numerics {arm.numerics}: --engine {engine} computes as the vLLM build's kernels do (the "
                        "embedded runtime models them: --engine reference --numerics vllm); remove --numerics or "
                        "the profile's numerics:")


class Engine(ABC):
    """Replays tokenized prompts for one arm at a time (control, then candidate)."""

    name: ClassVar[str]
    honours: ClassVar[frozenset[str]]  # the KNOBS this engine applies as asked
    local_checkpoints: ClassVar[bool] = False  # True: target/draft must be local directories (no hub ids)
    attaches: ClassVar[bool] = False  # True: each arm is a running server (--control-url/--candidate-url), not started

    def __init__(self, inventory: Inventory | None = None):
        from qual.engines.machine import ThisMachine

        self.inventory = inventory if inventory is not None else ThisMachine()  # what the machine has (tests: a fake)

    options_model: ClassVar[type[BaseModel]]  # the profile's section for this engine (`vllm:`), as it is validated

    @classmethod
    @abstractmethod
    def parse_options(cls, section: dict, where: str) -> dict:
        """The profile's section for this engine (e.g. `vllm:`), validated; unknown keys are a QualError."""

    @classmethod
    def options_schema(cls) -> dict:
        """The JSON Schema of the profile's section for this engine: the model that validates it."""
        return cls.options_model.model_json_schema()

    @abstractmethod
    def preflight(self, arm: ArmConfig, requested: frozenset[str]) -> ArmConfig:
        """Check the arm can run here before anything starts; return it as it will really run.

        `requested` names the knobs the user set explicitly: a knob the engine cannot apply as asked is a
        QualError (exit 2), never a run that claims a configuration it did not run.
        """

    def missing(self, arms: list[ArmConfig], gpu_memory_gib: float | None = None) -> list[str]:
        """What this machine lacks to run the arms, a phrase each ([]: nothing), asked of self.inventory before
        anything starts. The arms run one after the other on the same GPUs: on cuda, one GPU a rank of the widest arm,
        each with the most memory an arm's plan says (memory_need), else the profile's gpu_memory_gib. Engines add
        what else they need (an install, checkpoints)."""
        cuda = [arm for arm in arms if arm.device.startswith("cuda")]
        if not cuda:
            return []
        planned = [need for need in map(self.memory_need, cuda) if need is not None]
        need = max(planned, key=lambda n: n.bytes) if planned else None
        if need is None and gpu_memory_gib is not None:
            need = MemoryNeed(int(gpu_memory_gib * GIB), "the profile's gpu_memory_gib")
        widest = max(cuda, key=lambda arm: arm.tp)
        short = gpu_shortfall(self.inventory.gpus(), widest.device, widest.tp, need and need.bytes, need and need.how)
        return [short] if short else []

    def memory_need(self, arm: ArmConfig) -> MemoryNeed | None:
        """The memory each GPU of the arm needs by this engine's plan for its target; None where it has none."""
        return None

    def dry_check(self, arm: ArmConfig, requested: frozenset[str]) -> ArmConfig:
        """What preflight checks that needs nothing started, installed or present beyond the files (`--dry-run`):
        default nothing; return the arm as it would run."""
        return arm

    def version(self, arm: ArmConfig) -> str | None:
        """The engine_version this arm's run will record (ArmRunInfo.engine_version), known before it runs where the
        engine can tell (after preflight); None where it cannot yet. Part of the configuration key."""
        return None

    def max_model_len(self, arm: ArmConfig) -> int:
        """The most positions one request may use in this arm (default: the profile's max_model_len)."""
        return int(arm.extra["max_model_len"])

    def context_needed(self, arm: ArmConfig, prompt_tokens: int, max_tokens: int) -> int:
        """Positions a request of this size needs in this arm (the plan refuses one beyond max_model_len)."""
        return prompt_tokens + max_tokens

    @abstractmethod
    def describe(self, arm: ArmConfig) -> str:
        """One line for `--dry-run` (the server command, the runtime config); starts nothing."""

    @abstractmethod
    def run(self, arm: ArmConfig, requests: list[EngineRequest], on_result: OnResult, run_dir: Path,
            name: str) -> ArmRunInfo:
        """Replay every request, calling on_result as each finishes."""

    def notes(self, arm: ArmConfig) -> list[str]:
        """What the user should hear about this arm before it runs (a default the engine applies that another engine
        would not, for example): one line each, printed as warnings. Called after preflight."""
        return []

    def tokenize(self, arm: ArmConfig, prompts: list[str]) -> list[list[int]] | None:
        """The prompts' token ids as this arm's engine tokenizes them, where it has a tokenizer of its own (an attached
        server's /tokenize); None: qual's tokenization of the profile's tokenizer is what the engine gets."""
        return None

    @classmethod
    def doctor(cls) -> list[Any]:
        """What `qual doctor` should say about this engine on this machine (records.DoctorCheck)."""
        return []
