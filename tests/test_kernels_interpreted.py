"""The Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1), against the PyTorch path.

Each check runs in a fresh interpreter process: Triton reads TRITON_INTERPRET when a kernel is defined.
Skipped where Triton is not installed (it is in the dev extra; CUDA builds of torch bring it too).
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton)")

ROOT = Path(__file__).resolve().parents[1]

FUSED_DECODE = """
import tempfile
from pathlib import Path
from checkpoints import make_target
from runtime_helpers import prompts
from qual.runtime.config import CacheConfig, EngineConfig, SamplingParams
from qual.runtime.engine import LLMEngine
from qual.runtime.fused_decode import FusedDecode

with tempfile.TemporaryDirectory() as tmp:
    target = make_target(Path(tmp) / "t", num_key_value_heads={kv}, head_dim={head_dim})
    cfg = EngineConfig(str(target), dtype="float32", cache=CacheConfig(block_size=4, memory_bytes=2**22))
    reqs, sp = prompts(3), SamplingParams(max_tokens=12)
    with LLMEngine(cfg) as engine:
        ref = [engine.generate([r], sp)[0].output_token_ids for r in reqs]
        fused = engine.runner.target.fused = FusedDecode(engine.runner.target, programs={programs}, sync=False)
        got = [engine.generate([r], sp)[0].output_token_ids for r in reqs]
    assert fused.flags is not None, "the fused path never ran"
    assert got == ref, (got, ref)
print("ok")
"""


def interpret(code: str) -> None:
    path = [str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("kv,head_dim,programs", [(2, 32, 5), (1, 16, 3)], ids=["gqa2-dot", "gqa4-broadcast"])
def test_fused_decode_gives_the_per_layer_tokens(kv, head_dim, programs):
    """One kernel for all layers (run phase by phase: the interpreter has no concurrent programs) generates
    the same greedy tokens as the per-layer path, float32. head_dim 32 takes the tl.dot attention, 16 the
    broadcast one; the keys are split over 2 and 3 chunks per KV head (3: a non-power-of-2 merge)."""
    interpret(FUSED_DECODE.format(kv=kv, head_dim=head_dim, programs=programs))
