"""Compile, for a Hopper GPU, every Triton kernel a script launches, on the CPU: the compiler's own checks.

Triton's interpreter (tests/test_kernels_interpreted.py) runs the kernels' Python, and accepts code the compiler
refuses (a global that is not a constexpr, say). Here each launch is recorded instead of run, and its kernel is
compiled from the launch's own argument types for sm_90 (Triton's front end, its MLIR passes and ptxas, all on the
CPU). `python tests/hopper_compile.py < SCRIPT` runs the script and prints one line a compiled kernel, then "ok";
with --ptx, each kernel's PTX after its line.
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

HOPPER = GPUTarget("cuda", 90, 32)


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict):
    """The kernel compiled for sm_90 from one launch's arguments, specialised as a launch on the GPU would be: the
    constexprs by value, the rest by type, and integers and pointers by their divisibility by 16 (what lets the
    compiler vectorise loads and pipeline loops: without it every load is a scalar one)."""
    backend = make_backend(HOPPER)
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = bind(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    if kernel.is_gluon():  # Gluon kernels lower from their own source type (TTGIR, layouts given)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = ASTSource
    return triton.compile(source(kernel, signature, constexprs, attrs), target=HOPPER, options=options.__dict__)


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


def loads_before_pdl_wait(ptx: str) -> int | None:
    """How many global loads (ld.global and cp.async from global) the kernel's PTX issues before its first
    `griddepcontrol.wait`, None without one: what a kernel launched with PDL reads before the kernel before is done."""
    head, wait, _ = ptx.partition("griddepcontrol.wait")
    if not wait:
        return None
    return len(re.findall(r"^\s*(?:@%p\d+\s+)?(?:ld\.global|cp\.async\.c[ag]\.shared\.global)", head, re.M))


def main(script: str, ptx: bool = False) -> None:
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record  # the launch is recorded, not run: there is no GPU
    try:
        exec(compile(script, "<script>", "exec"), {"__name__": "__script__"})
    except Exception as exc:  # what the script does with outputs never written ends it; the launches are in
        print(f"script stopped after {len(launches)} launches: {type(exc).__name__}: {exc}")
    assert launches, "the script launched no Triton kernel"
    print(f"compiled by Triton {triton.__version__} for sm_90")
    seen = set()
    for kernel, args, kwargs in launches:
        compiled = compile_launch(kernel, args, kwargs)
        key = (kernel.__name__, compiled.hash)
        if key not in seen:
            seen.add(key)
            regs, stack = resources(compiled)
            line = (f"{kernel.__name__}: {compiled.metadata.num_warps} warps, {compiled.metadata.shared} B shared, "
                    f"{regs} registers, {stack} B stack")
            if (early := loads_before_pdl_wait(compiled.asm["ptx"])) is not None:
                line += f", {early} global loads before its PDL wait"
            print(line)
            if ptx:
                print("PTX:\n" + compiled.asm["ptx"])
    print("ok")


if __name__ == "__main__":
    main(sys.stdin.read(), ptx="--ptx" in sys.argv[1:])
