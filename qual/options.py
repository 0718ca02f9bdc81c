"""The run options' vocabulary: every value an option may take and its default, spelled here and nowhere else.

The command line, the plan, profiles, `qual generate`, the engines and the runtime config read these names (a test
fails on a list of these values or a default spelled anywhere else: tests/test_options.py). No torch, no engine:
every layer may import it.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator

from qual.errors import QualError
from qual.validation import ascii_digits

# Floating-point types a run computes in (torch's names)
DTYPES = ("float32", "float64", "bfloat16", "float16")
DEFAULT_DTYPE = "float32"
Dtype = Literal[DTYPES]

# The drafter's KV cache under DCP: one copy on every DCP rank (the fix), or sequence-sharded like the target's
# (the legacy bug qual exists to catch: a drafter has no LSE merge, docs/dflash.md)
DRAFT_KV_MODES = REPLICATED, SHARDED = ("replicated", "sharded")
DEFAULT_DRAFT_KV = REPLICATED
DraftKv = Literal[DRAFT_KV_MODES]
# What an arm records where the engine cannot observe it (an attached server's build decides and does not say)
NOT_OBSERVED = "unknown"

# Sparse-attention (DSA) top-k under DCP: the global top-k, equal to DCP 1; or each rank's own, unioned
DSA_TOPK_MODES = ("exact", "union")
DEFAULT_DSA_TOPK = "exact"
DsaTopk = Literal[DSA_TOPK_MODES]

# How a target with a choice (GLM-5.3-Flash) computes: as written (transformers' form, float weights, unquantized
# activations), or as vLLM's kernels compute it: its FP8 Hadamard indexer, FP8 activations before FP8 GEMMs,
# float32 hyper-connection mixes, the KDA safe gate; vllm-hopper adds what DeepGEMM changes on H100/H200 (power-of-two
# scales). docs/glm5.md, "Numerics".
NUMERICS = ("exact", "vllm", "vllm-hopper")
DEFAULT_NUMERICS = "exact"
Numerics = Literal[NUMERICS]

# How DCP ranks merge their partial attention: vLLM's two backends (one all-to-all, or an all-gather of the LSEs and a
# reduce-scatter), and the reference engine's own: a fixed merge tree over virtual shards, DCP 1's bits at every DCP
# size (docs/dcp.md, "The invariant merge")
VLLM_DCP_COMM_MODES = ("a2a", "ag_rs")
INVARIANT = "invariant"
DCP_COMM_MODES = (*VLLM_DCP_COMM_MODES, INVARIANT)
DEFAULT_DCP_COMM = "a2a"
DcpComm = Literal[DCP_COMM_MODES]
VllmDcpComm = Literal[VLLM_DCP_COMM_MODES]

DEVICES = ("cpu", "cuda", "cuda:N")  # cuda:N: the N-th GPU
DEFAULT_DEVICE = "cpu"

# Hub revisions a profile may pin for a target or drafter given as a hub id; ArmConfig.extra keys of the same names
# (set only when named): the vLLM engine applies them, the others refuse them, provenance records them.
REVISION_KEYS = ("target_revision", "draft_revision")

DEFAULT_ENGINE = "reference"  # the engines' names are the registry's (qual/engines/registry.py)

DEFAULT_DCP = 4  # the candidate's DCP size when neither --dcp nor the profile says
# Several values of --dcp, --draft-kv or --dsa-topk make a run a sweep (qual/harness/sweep.py): "--dcp 2,4"
SWEEP_SEPARATOR = ","
DEFAULT_TEMPERATURE = 0.0  # greedy
MAX_SEED = 2**63 - 1  # seeds travel as int64 (numpy, torch, vLLM's sampling params)


def check_choice(what: str, value, allowed: tuple[str, ...]) -> str:
    """value if it is one of allowed, else a QualError naming `what`."""
    if value not in allowed:
        raise QualError(f"{what} must be one of {', '.join(allowed)} (got {value!r})")
    return value


def is_device(value: str) -> bool:
    """cpu, cuda or cuda:N."""
    return value in ("cpu", "cuda") or (value.startswith("cuda:") and ascii_digits(value[5:]))


def check_device(what: str, value: str) -> str:
    if not is_device(value):
        raise QualError(f"{what} must be {', '.join(DEVICES[:-1])} or {DEVICES[-1]} (got {value!r})")
    return value


def _device(value: str) -> str:
    if not is_device(value):
        raise ValueError(f"must be {', '.join(DEVICES[:-1])} or {DEVICES[-1]}")
    return value


# A device as an option or profile key holds it: refused in words, never with a regular expression
Device = Annotated[str, AfterValidator(_device)]


def check_temperature(what: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise QualError(f"{what} must be a finite number >= 0 (got {value!r})")
    return float(value)


def check_layout(tp: int, dcp: int, interleave: int = 1, tp_from: str | None = None) -> None:
    """TP and DCP sizes every engine can run: DCP groups split the TP group (docs/dcp.md). tp_from: where a TP size
    nobody gave on the command line came from (the profile's tp), for the message."""
    if tp < 1 or dcp < 1 or interleave < 1:
        raise QualError(f"tp, dcp and interleave must be >= 1 (got tp={tp}, dcp={dcp}, interleave={interleave})")
    if tp % dcp:
        where = f" ({tp_from}; --tp sets another)" if tp_from else ""
        raise QualError(f"constraint tp % dcp == 0 violated: tp={tp}{where} is not divisible by dcp={dcp}")
