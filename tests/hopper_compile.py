"""Compile, for a Hopper GPU, every Triton kernel a script launches, on the CPU: the compiler's own checks.

Triton's interpreter (tests/test_kernels_interpreted.py) runs the kernels' Python, and accepts code the compiler
refuses (a global that is not a constexpr, say). Here each launch is recorded instead of run, and its kernel is
compiled from the launch's own argument types for sm_90 (Triton's front end, its MLIR passes and ptxas, all on the
CPU). `python tests/hopper_compile.py < SCRIPT` runs the script and prints one line a compiled kernel, then "ok".
"""

import dataclasses
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDAOptions
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

HOPPER = GPUTarget("cuda", 90, 32)
OPTIONS = {f.name for f in dataclasses.fields(CUDAOptions)}
DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a launch argument of type {type(value).__name__}")


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict):
    """The kernel compiled for sm_90 from one launch's arguments (constexprs by value, the rest by type)."""
    bound = dict(zip(kernel.arg_names, args))
    bound.update((k, v) for k, v in kwargs.items() if k in kernel.arg_names)
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound.get(param.name, param.default)
        if param.is_constexpr:
            signature[param.name], constexprs[(param.num,)] = "constexpr", value
        else:
            signature[param.name] = _type(value)
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    return triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER, options=options)


def resources(compiled) -> tuple[int, int]:
    """Registers a thread and bytes of stack (registers spilled) of a compiled kernel, from its cubin
    (`cuobjdump -res-usage`, shipped with Triton's NVIDIA backend)."""
    tool = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return int(usage[1]), int(usage[2])


def main(script: str) -> None:
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record  # the launch is recorded, not run: there is no GPU
    try:
        exec(compile(script, "<script>", "exec"), {"__name__": "__script__"})
    except Exception as exc:  # what the script does with outputs never written ends it; the launches are in
        print(f"script stopped after {len(launches)} launches: {type(exc).__name__}: {exc}")
    assert launches, "the script launched no Triton kernel"
    seen = set()
    for kernel, args, kwargs in launches:
        compiled = compile_launch(kernel, args, kwargs)
        key = (kernel.__name__, compiled.hash)
        if key not in seen:
            seen.add(key)
            regs, stack = resources(compiled)
            print(f"{kernel.__name__}: {compiled.metadata.num_warps} warps, {compiled.metadata.shared} B shared, "
                  f"{regs} registers, {stack} B stack")
    print("ok")


if __name__ == "__main__":
    main(sys.stdin.read())
