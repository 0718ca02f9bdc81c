"""Split-K Triton GEMM for decode's skinny products: y[M, N] = x[M, K] @ w[N, K]^T with M <= 16.

At batch 1-2 a decode step's projections are matrix-vector products of a few MB of weights each: too few
output columns for a kernel that gives each program a whole column block to keep enough loads in flight to use
the HBM. Here every program streams a [BLOCK_N, K / split] slab of w once and multiplies it with x padded to 16
rows on the tensor cores; `split` programs share each output column block so that enough loads are in flight.
`python3 bench/skinny_gemm_sweep.py` times its configurations against cuBLAS (docs/PERFORMANCE.md).
The kernel writes float32 partial sums [split, M, N]; their sum (in PyTorch, where torch.compile
fuses it into the next elementwise kernel) is the product.

With programmatic dependent launch (`pdl`, Hopper and later) a launch may start while the kernel before it
finishes: each program waits for that kernel (whose output x is) before its first load, then lets the kernel
after it launch. PDL pays where a product is followed by a small kernel, as everywhere in a decode step, and costs
where two products follow each other (bench/skinny_gemm_sweep.py --chain measures both; docs/PERFORMANCE.md),
likely because a grid launched early holds SM slots while it waits. Asking L2 for the first columns of each slab
before the wait was tried and was slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

MAX_ROWS = 16  # one tensor-core tile of rows
TARGET_PROGRAMS = 256  # ~2 per SM on an H200 (132 SMs): enough loads in flight to stream the weights from HBM


@dataclass(frozen=True)
class GemmConfig:
    block_n: int = 64
    block_k: int = 64
    split: int = 1
    num_warps: int = 4
    # 4 stages: the best, or within noise of it, on every 0.6B-shape projection at 1 and 8 rows
    # (python3 bench/skinny_gemm_sweep.py on one H200)
    num_stages: int = 4


def available() -> bool:
    return triton is not None


def pdl_available() -> bool:
    """Whether this Triton can launch with programmatic dependent launch (the GPU must be Hopper or later)."""
    if triton is None:
        return False
    try:
        import triton.language.extra.cuda as cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


# The best configuration of bench/skinny_gemm_sweep.py's grid at 1 and 8 rows on one H200 for the 8B shape's
# products (w [N, K]), where it beats choose_config's rule: qkv, o, down and the LM head (gate_up: the rule's)
SWEPT = {
    (6144, 4096): GemmConfig(block_n=32, block_k=128, split=2),
    (4096, 4096): GemmConfig(block_n=64, block_k=128, split=4, num_stages=3),
    (4096, 14336): GemmConfig(block_n=64, block_k=128, split=4),
    (128256, 4096): GemmConfig(block_n=64, block_k=128, split=1),
}


def choose_config(n: int, k: int, block_n: int = 64, block_k: int = 64) -> GemmConfig:
    """The swept configuration of a product of this shape (SWEPT), else: split K until at least TARGET_PROGRAMS
    programs run, keeping >= 2 K blocks per program.

    For the Qwen3-0.6B projections the rule gives the best split of bench/skinny_gemm_sweep.py's grid: 4 for qkv
    and gate_up, 16 for o and down.
    """
    if (n, k) in SWEPT:
        return SWEPT[n, k]
    blocks = math.ceil(n / block_n)
    split = 1
    while blocks * split < TARGET_PROGRAMS and k // (split * 2) >= 2 * block_k:
        split *= 2
    return GemmConfig(block_n, block_k, split)


def split_width(k: int, cfg: GemmConfig) -> int:
    """The columns of K each of a product's cfg.split programs multiplies: whole blocks of cfg.block_k."""
    return math.ceil(math.ceil(k / cfg.split) / cfg.block_k) * cfg.block_k


if triton is not None:

    @triton.jit
    def split_k_tile(x_ptr, w_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                     PDL: tl.constexpr, ln_ptr=None, w_half=0, NORM: tl.constexpr = False, PAIR: tl.constexpr = False,
                     UPCAST: tl.constexpr = False, LATE_LAUNCH: tl.constexpr = False):
        """This program's partial of the split-K product, float32 [BLOCK_M, BLOCK_N], with its rows rm and output
        columns rn: program (n, s) multiplies x by w's column block n over the s-th k_per_split of K. With PDL it
        first waits for the kernel before (whose output x is). The kernels that finish the product differently call
        it; fused-layer's (fused_layer.py) with its options: NORM multiplies x's tile by ln at the load (rounded
        once); PAIR reads BLOCK_N / 2 rows of w from n * BLOCK_N / 2 and the matching rows from w_half on (gate/up:
        a gate block and its up block in one tile, rn then the gate rows); UPCAST multiplies in float32 (Triton's
        interpreter: its bf16 dot is wrong); LATE_LAUNCH lets the next kernel launch after the last load is issued
        instead of after the wait."""
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        if PAIR:
            j = tl.arange(0, BLOCK_N)
            rn = pid_n * (BLOCK_N // 2) + (j % (BLOCK_N // 2))
            w_rows = tl.where(j < BLOCK_N // 2, rn, w_half + rn)
            w_ok = rn < w_half
        else:
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            w_rows = rn
            w_ok = rn < N
        k_lo = pid_s * k_per_split
        if PDL:
            tl.extra.cuda.gdc_wait()  # x is the kernel before's output
            if not LATE_LAUNCH:
                tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
            if NORM:  # the norm's weight at the load: x * ln rounded once
                ln = tl.load(ln_ptr + rk, mask=rk < K, other=0.0)
                x = (x.to(tl.float32) * ln.to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty)
            w_ptrs = w_ptr + w_rows[:, None] * stride_wn + rk[None, :]
            if EVEN_N and EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")  # read once: keep L2 for what is read again
            else:
                w = tl.load(w_ptrs, mask=w_ok[:, None] & (rk[None, :] < K), other=0.0, eviction_policy="evict_first")
            if UPCAST:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
            else:
                acc += tl.dot(x, tl.trans(w))
        if PDL and LATE_LAUNCH:  # the stream issued: the next kernel's grid may take the slots programs leave
            tl.extra.cuda.gdc_launch_dependents()
        return acc, rm, rn

    @triton.jit
    def _partials_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
        acc, rm, rn = split_k_tile(x_ptr, w_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                                   EVEN_N, EVEN_K, PDL)
        out = out_ptr + tl.program_id(1) * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def partials(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """float32 [split, M, N] whose sum over dim 0 is x @ w.T (x [M, K] with M <= 16, w [N, K] row-major).
    pdl: launched with programmatic dependent launch (pdl_available(), a GPU of compute capability >= 9)."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS or w.shape[1] != k or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} w {tuple(w.shape)} (need M <= {MAX_ROWS}, unit K stride)")
    cfg = cfg or choose_config(n, k)
    k_per_split = split_width(k, cfg)
    out = torch.empty(cfg.split, m, n, device=x.device, dtype=torch.float32)
    grid = (math.ceil(n / cfg.block_n), cfg.split)
    launch = {"launch_pdl": True} if pdl else {}
    _partials_kernel[grid](x, w, out, m, n, k, k_per_split, x.stride(0), w.stride(0),
                           BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                           EVEN_N=n % cfg.block_n == 0, EVEN_K=k % (cfg.split * cfg.block_k) == 0, PDL=pdl,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch)
    return out


if triton is not None:
    # As a custom op, torch.compile keeps the launch as one opaque node and fuses the sum after it.
    @torch.library.custom_op("qual::skinny_gemm_partials", mutates_args=())
    def _partials_op(x: torch.Tensor, w: torch.Tensor, pdl: bool) -> torch.Tensor:
        return partials(x, w, pdl=pdl)

    @_partials_op.register_fake
    def _(x, w, pdl):
        split = choose_config(w.shape[0], x.shape[1]).split
        return x.new_empty(split, x.shape[0], w.shape[0], dtype=torch.float32)


def linear(x: torch.Tensor, w: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x @ w.T for x [..., K]: the split-K kernel when the rows fit one tile, else torch's linear."""
    rows = math.prod(x.shape[:-1])
    if triton is None or rows > MAX_ROWS or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return torch.nn.functional.linear(x, w)
    flat = x.reshape(rows, x.shape[-1])
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    return _partials_op(flat, w, pdl).sum(0).to(x.dtype).view(*x.shape[:-1], w.shape[0])
