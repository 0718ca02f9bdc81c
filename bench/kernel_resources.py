"""Registers, spill stack and shared memory of the one-kernel decode step, compiled for a GPU without one.

    python3 bench/kernel_resources.py [--arch 90] [--tilings 8x32xqm,8x16xqm,...] [--work 7,1,2,4]

Compiles qual/runtime/kernels/decode_layers.py for the Qwen3-0.6B shape ahead of time with the Triton
installed here (its own ptxas) and prints cuobjdump's resource usage per variant. Spills cost the fused
kernel time on the GPU (docs/PERFORMANCE.md), and this shows them on a CPU-only machine: use the Triton
version of the device (3.6 with torch 2.11) for numbers that match it.
Variants: num_warps x MLP rows a step x weights requested before a barrier (q: q/k/v, m: the MLP's);
--work: phases compiled in (1 q/k/v, 2 attention, 4 MLP), to see which phase needs the registers.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qual.runtime.kernels.decode_layers import _decode_layers_kernel  # noqa: E402

BF16_POINTERS = ("ln1_ptr", "ln2_ptr", "wqkv_ptr", "qn_ptr", "kn_ptr", "wo_ptr", "wgu_ptr", "wdt_ptr", "k_ptr", "v_ptr")
SIGNATURE = {"resid_ptr": "*fp32", "qkv_ptr": "*fp32", "part_ptr": "*fp32", "flags_ptr": "*i32", "timeout_ptr": "*i32",
             "times_ptr": "*i64",
             "pos_ptr": "*i64", "wslot_ptr": "*i64", "slots_ptr": "*i64", "mask_ptr": "*i8", "S": "i32",
             **{n: "*bf16" for n in BF16_POINTERS}, "inv_freq_ptr": "*fp32", "cache_layer_stride": "i32",
             "cache_slot_stride": "i32", "first_phase": "i32", "last_phase": "i32", "eps": "fp32", "scale": "fp32"}
# Arguments a launch on the device specializes as multiples of 16 (every pointer; the strides, phase bounds): without
# this hint Triton cannot vectorize the weight loads, and the compile would not be the device's
ALIGNED = [k for k, v in SIGNATURE.items() if v.startswith("*")] + ["cache_layer_stride", "cache_slot_stride",
                                                                    "first_phase", "last_phase"]
# The 0.6B shape on 132 programs, 160 cached tokens (what bench/fused_decode_bench.py runs)
SHAPE = dict(H=1024, HB=1024, I=3072, NH=16, NKV=8, D=128, RQ=32, NC=16, NCB=16, RO=64, RI=24, BS=16, MQ=16,
             USE_DOT=True, PREC="tf32", SYNC=True, POLL_ACQUIRE=True, TIMING=False, RS=32, PF_QKV=True, PF_MLP=True,
             WORK=7)  # the default tiling


def compile_kernel(arch: int, num_warps: int, **constexprs):
    """The kernel compiled for sm_<arch> as a launch of the 0.6B shape compiles it on the device."""
    fn = _decode_layers_kernel
    const = {**SHAPE, **constexprs}
    src = ASTSource(fn=fn, signature={**SIGNATURE, **{k: "constexpr" for k in const}},
                    constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in ALIGNED})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def resources(arch: int, num_warps: int, **constexprs) -> dict:
    kernel = compile_kernel(arch, num_warps, **constexprs)
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    return {key: int(val) for key, val in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--tilings", default="8x32xqm,8x32xq,8x32x,8x16xqm,16x32xqm")
    ap.add_argument("--work", default="7,1,2,4")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="qual-triton-"))
    print(f"Triton {triton.__version__}, sm_{args.arch}")
    print(f"{'variant':>10s} {'work':>4s} {'REG':>5s} {'STACK':>6s} {'SHARED':>7s}")
    for spec in args.tilings.split(","):
        warps, step, pf = spec.split("x")
        for work in (int(w) for w in args.work.split(",")):
            r = resources(args.arch, int(warps), RS=int(step), PF_QKV="q" in pf, PF_MLP="m" in pf, WORK=work)
            print(f"{spec:>10s} {work:4d} {r.get('REG', 0):5d} {r.get('STACK', 0):6d} {r.get('SHARED', 0):7d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
