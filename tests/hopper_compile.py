"""Compile, for a Hopper GPU, every Triton kernel a script launches, on the CPU: the compiler's own checks.

Triton's interpreter (tests/test_kernels_interpreted.py) runs the kernels' Python, and accepts code the compiler
refuses (a global that is not a constexpr, say). Here each launch is recorded instead of run, and its kernel is
compiled from the launch's own argument types for sm_90 (Triton's front end, its MLIR passes and ptxas, all on the
CPU). `python tests/hopper_compile.py < SCRIPT` runs the script and prints one line a compiled kernel, then "ok".
"""

import dataclasses
import sys

import torch
import triton
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
            print(f"{kernel.__name__}: {compiled.metadata.num_warps} warps, {compiled.metadata.shared} B shared")
    print("ok")


if __name__ == "__main__":
    main(sys.stdin.read())
