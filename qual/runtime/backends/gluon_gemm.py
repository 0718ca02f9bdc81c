"""Decode's skinny products in Gluon (Triton's explicit-layout language, Hopper): y[M, N] = x[M, K] @ w[N, K]^T for
M <= 16, the weight streamed by TMA through a ring of shared-memory stages by a producer warp. Its product core
(`_product`) is the backend part gluon-layer's (qual/runtime/backends/gluon_layer.py); the chain of
bench/skinny_gemm_sweep.py runs the plain and finishing forms here (docs/PERFORMANCE.md: as the projections' kernel
of the compiled 8B step it ties the split-K kernel end to end, so no backend runs them).

Why not the split-K Triton kernel (qual/runtime/backends/skinny_gemm.py): there each program's own warps issue its
loads (`cp.async`, the pipeliner's stages) and wait for them between tensor-core products, and a program launched
early with programmatic dependent launch (PDL) cannot load anything before its wait, since only Triton knows which
loads are x. Here the work is split by warps instead:

- a producer warp (a `gl.warp_specialize` worker) issues TMA copies of the weight tiles into a ring of STAGES
  shared-memory buffers, each signalled on an mbarrier when its bytes land. The first pass through the ring is
  issued before the PDL wait (a weight is nobody's output), then the wait, then x's tiles (x is the kernel before's
  output); every later stage waits for the consumer to free it;
- the consumer warp group multiplies each stage on the tensor cores (`warpgroup_mma`, the weight tile as the
  product's A [BLOCK_N, BLOCK_K] and x's tile, transposed in place, as its B [BLOCK_K, 16]: rows of w are the wide
  side, so the 16 padded rows of x are the instruction's N) and frees the stage;
- after both, the program's warps store its float32 partial [M, BLOCK_N] of split s (`partials`, as
  skinny_gemm.partials does), or (`finished`) the last program of each column block to arrive sums the partials,
  adds a residual and writes the product in x's dtype, so that the next product reads it with no kernel between.

The grid is the split-K one (column blocks x splits), sized by `choose_config` to fit in one wave (every program
resident at once, two an SM), so that a program launched early never takes a slot another program of its own
product is waiting for. Triton's interpreter does not run Gluon: tests/test_kernels_compile.py compiles it for sm_90
on the CPU with the GPU image's Triton, tests/test_gpu.py checks it against float64 on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # CPU-only torch builds ship no Triton; a Triton before 3.4 has no Gluon
    gluon = None

ROWS = 16  # x's rows padded to the tensor-core product's N (TMA fills the rows past M with zeros)
SMS = 132  # streaming multiprocessors of an H100 / H200: a grid of at most 2 x SMS programs runs in one wave
PROGRAMS_AN_SM = 2
# Splits a product at most: inductor unrolls a reduction of fewer than 8 elements (unroll_reductions_threshold) and
# fuses the sum over splits into the compiled step's next kernel; at 8 it launched a kernel of its own for each sum
# (the 8B step: 96 kernels more, docs/PERFORMANCE.md)
MAX_SPLIT = 7
# Registers a thread at launch: a program is 8 warps (the consumer's group and the producer's, rounded to a group),
# so 96 lets two programs share an SM's 64K registers with a quarter left for the small kernel after them, launched
# early with PDL (the producer gives most of its share to the consumer)
MAX_REGISTERS = 96


@dataclass(frozen=True)
class GluonConfig:
    """One product's tiling: BLOCK_N weight rows x BLOCK_K columns a stage, `stages` stages, `split` programs a
    column block."""

    block_n: int = 128
    block_k: int = 64
    split: int = 1
    stages: int = 4

    def smem_bytes(self) -> int:
        """Shared memory a program takes: the ring of weight and x tiles (mbarriers besides: a few bytes)."""
        return self.stages * (self.block_n + ROWS) * self.block_k * 2


# Gluon's API moves between Triton releases (3.9 renamed the TMA copies, for one): the kernels are written against
# the GPU image's Triton (Makefile: DEVICE_TRITON_VERSION)
GLUON_TRITON = "3.6."


def available() -> bool:
    """Whether this Triton has the Gluon the kernels are written in (the GPU must be Hopper or later to run them)."""
    return gluon is not None and triton.__version__.startswith(GLUON_TRITON)


def choose_config(n: int, k: int, block_n: int = 128, block_k: int = 64, stages: int = 4) -> GluonConfig:
    """Split K so that the grid fills one wave of PROGRAMS_AN_SM programs an SM (at least one K tile a program, at most
    MAX_SPLIT splits); a product with more column blocks than that runs unsplit, in several waves."""
    blocks = math.ceil(n / block_n)
    tiles = math.ceil(k / block_k)
    split = max(1, min(tiles, MAX_SPLIT, (PROGRAMS_AN_SM * SMS) // blocks))
    return GluonConfig(block_n, block_k, split, stages)


def tiles_per_split(k: int, cfg: GluonConfig) -> int:
    """The K tiles each of a product's cfg.split programs multiplies (the last program's may run past K: TMA reads
    zeros there)."""
    return math.ceil(math.ceil(k / cfg.block_k) / cfg.split)


if gluon is not None:

    @gluon.jit
    def _gdc_wait():
        """Wait for the kernel before (PDL) to finish and its writes to be visible."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _gdc_launch_dependents():
        """Let the kernel after launch (PDL) once every program has said so or exited."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _issue_weight(w_desc, w_buf, bar, n0, k, pair, PAIR: gl.constexpr):
        """One stage's weight tile: rows n0.. of w, or with PAIR two half tiles, rows n0.. and pair + n0.. (gate/up:
        a gate block and its up block, read in place from [gate; up])."""
        if PAIR:
            H: gl.constexpr = w_desc.block_type.shape[0]
            tma.async_copy_global_to_shared(w_desc, [n0, k], bar, w_buf.slice(0, H))
            tma.async_copy_global_to_shared(w_desc, [pair + n0, k], bar, w_buf.slice(H, H))
        else:
            tma.async_copy_global_to_shared(w_desc, [n0, k], bar, w_buf)

    @gluon.jit
    def _load_partition(w_desc, x_desc, w_bufs, x_bufs, ready, empty, n0, k0, pair, TILES: gl.constexpr,
                        PDL: gl.constexpr, PAIR: gl.constexpr):
        """The producer warp: TILES weight and x tiles from column k0 on, through the ring."""
        STAGES: gl.constexpr = w_bufs.type.shape[0]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        NBYTES: gl.constexpr = w_desc.block_type.nbytes * (2 if PAIR else 1) + x_desc.block_type.nbytes
        FIRST: gl.constexpr = STAGES if STAGES < TILES else TILES
        # The ring's first pass: weight tiles before the wait (they are no kernel's output), x's after it.
        for i in gl.static_range(FIRST):
            mbarrier.expect(ready.index(i), NBYTES)
            _issue_weight(w_desc, w_bufs.index(i), ready.index(i), n0, k0 + i * BLOCK_K, pair, PAIR)
        if PDL:
            _gdc_wait()
            _gdc_launch_dependents()
        for i in gl.static_range(FIRST):
            tma.async_copy_global_to_shared(x_desc, [0, k0 + i * BLOCK_K], ready.index(i), x_bufs.index(i))
        for i in range(FIRST, TILES):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the consumer's release of the pass before
            mbarrier.expect(ready.index(s), NBYTES)
            _issue_weight(w_desc, w_bufs.index(s), ready.index(s), n0, k0 + i * BLOCK_K, pair, PAIR)
            tma.async_copy_global_to_shared(x_desc, [0, k0 + i * BLOCK_K], ready.index(s), x_bufs.index(s))

    @gluon.jit
    def _mma_partition(w_bufs, x_bufs, ready, empty, TILES: gl.constexpr, acc_layout: gl.constexpr):
        """The consumer warp group: acc[BLOCK_N, ROWS] = w tiles @ x tiles^T, each stage freed once multiplied."""
        STAGES: gl.constexpr = w_bufs.type.shape[0]
        BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
        R: gl.constexpr = x_bufs.type.shape[1]
        acc = gl.zeros([BLOCK_N, R], gl.float32, acc_layout)
        for i in range(TILES):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(w_bufs.index(s), x_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(s), count=1)
        return (acc,)  # warp_specialize hands on the default partition's results as a tuple

    @gluon.jit
    def _product(w_desc, x_desc, n0, k0, TILES: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                 acc_layout: gl.constexpr, pair=0, PAIR: gl.constexpr = False):
        """This program's product, float32 [BLOCK_N, ROWS] (x @ w^T transposed) over TILES K tiles from k0; with PAIR
        the tile's halves are w's rows n0.. and pair + n0.. (_issue_weight)."""
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0] * (2 if PAIR else 1)
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        R: gl.constexpr = x_desc.block_type.shape[0]
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, R, BLOCK_K], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        acc, = gl.warp_specialize([
            (_mma_partition, (w_bufs, x_bufs, ready, empty, TILES, acc_layout)),
            (_load_partition, (w_desc, x_desc, w_bufs, x_bufs, ready, empty, n0, k0, pair, TILES, PDL, PAIR)),
        ], [1], [24])
        if PDL:  # what the program writes next may be what the kernel before reads (the allocator hands it on)
            _gdc_wait()
        return acc

    @gluon.jit
    def _partials_kernel(w_desc, x_desc, out_ptr, M, N, TILES: gl.constexpr, STAGES: gl.constexpr,
                         PDL: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        R: gl.constexpr = x_desc.block_type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, R, 16])
        pid_n, pid_s = gl.program_id(0), gl.program_id(1)
        n0 = pid_n * BLOCK_N
        acc = _product(w_desc, x_desc, n0, pid_s * TILES * BLOCK_K, TILES, STAGES, PDL, acc_layout)
        rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        rm = gl.arange(0, R, layout=gl.SliceLayout(0, acc_layout))
        ptrs = out_ptr + pid_s * M * N + rm[None, :] * N + rn[:, None]  # acc is the partial transposed
        gl.store(ptrs, acc, mask=(rm[None, :] < M) & (rn[:, None] < N))

    @gluon.jit
    def _finished_kernel(w_desc, x_desc, part_ptr, cnt_ptr, res_ptr, out_ptr, M, N, scale, TILES: gl.constexpr,
                         STAGES: gl.constexpr, SPLIT: gl.constexpr, RESIDUAL: gl.constexpr, PDL: gl.constexpr,
                         num_warps: gl.constexpr):
        """out[M, N] = scale * x @ w^T (+ residual) in out's dtype: each program stores its float32 partial, and
        the last of a column block's SPLIT programs to arrive (an atomic count, reset for the next launch) sums
        them, so the next kernel reads the product finished."""
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        R: gl.constexpr = x_desc.block_type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, R, 16])
        pid_n, pid_s = gl.program_id(0), gl.program_id(1)
        n0 = pid_n * BLOCK_N
        acc = _product(w_desc, x_desc, n0, pid_s * TILES * BLOCK_K, TILES, STAGES, PDL, acc_layout)
        rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        rm = gl.arange(0, R, layout=gl.SliceLayout(0, acc_layout))
        tile = rm[None, :] * N + rn[:, None]
        ok = (rm[None, :] < M) & (rn[:, None] < N)
        last = True
        if SPLIT > 1:
            gl.store(part_ptr + pid_s * M * N + tile, acc, mask=ok)
            gl.thread_barrier()  # every thread's share stored before the count says this program is done
            arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            last = arrived == SPLIT - 1
        if last:  # the others' partials are all stored: sum them (from L2, not a stale L1)
            if SPLIT > 1:
                gl.thread_barrier()
                acc = gl.zeros([BLOCK_N, R], gl.float32, acc_layout)
                for s in range(SPLIT):
                    acc += gl.load(part_ptr + s * M * N + tile, mask=ok, other=0.0, cache_modifier=".cg")
                gl.atomic_xchg(cnt_ptr + pid_n, 0)
            y = acc * scale
            if RESIDUAL:
                y += gl.load(res_ptr + tile, mask=ok, other=0.0).to(gl.float32)
            gl.store(out_ptr + tile, y.to(out_ptr.dtype.element_ty), mask=ok)


def _descriptors(x: torch.Tensor, w: torch.Tensor, cfg: GluonConfig, pair: bool = False):
    """TMA descriptors of w [N, K] in [block_n, block_k] tiles (with pair, half tiles of block_n / 2 rows in the whole
    tile's shared layout: _issue_weight puts two in one stage) and x [M, K] in [ROWS, block_k] tiles."""
    gl_dtype = gl.bfloat16 if w.dtype == torch.bfloat16 else gl.float16
    w_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_k], gl_dtype)
    x_layout = gl.NVMMASharedLayout.get_default_for([ROWS, cfg.block_k], gl_dtype)
    return (TensorDescriptor.from_tensor(w, [cfg.block_n // 2 if pair else cfg.block_n, cfg.block_k], w_layout),
            TensorDescriptor.from_tensor(x, [ROWS, cfg.block_k], x_layout))


def check_operands(x: torch.Tensor, w: torch.Tensor) -> None:
    """Refuse operands the kernel cannot read: more than ROWS rows, K not unit-strided, rows not 16-byte aligned
    (what TMA needs), another dtype than bf16/fp16 or x's and w's differing."""
    m, k = x.shape
    if (m > ROWS or w.shape[1] != k or w.stride(1) != 1 or x.stride(1) != 1 or (w.stride(0) * 2) % 16
            or (x.stride(0) * 2) % 16 or x.dtype != w.dtype or w.dtype not in (torch.bfloat16, torch.float16)
            or w.data_ptr() % 16 or x.data_ptr() % 16):
        raise ValueError(f"gluon_gemm: x {tuple(x.shape)} {x.dtype} stride {x.stride()}, w {tuple(w.shape)} "
                         f"{w.dtype} stride {w.stride()} (need M <= {ROWS}, bf16/fp16, unit K stride, rows and "
                         "bases 16-byte aligned)")


def finished(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, residual: torch.Tensor | None = None,
             scale: float = 1.0, cfg: GluonConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """[M, N] in x's dtype = scale * x @ w.T (+ residual [M, N], contiguous), the split-K partials summed by each
    column block's last program (counts: int32 zeros, one a column block at least, left zero)."""
    check_operands(x, w)
    m, k = x.shape
    n = w.shape[0]
    cfg = cfg or choose_config(n, k)
    if counts.numel() < math.ceil(n / cfg.block_n):
        raise ValueError(f"gluon_gemm.finished: {counts.numel()} counts for {math.ceil(n / cfg.block_n)} column blocks")
    if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"gluon_gemm.finished: residual {tuple(residual.shape)} (need contiguous [{m}, {n}])")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts = torch.empty(cfg.split, m, n, device=x.device, dtype=torch.float32) if cfg.split > 1 else out
    w_desc, x_desc = _descriptors(x, w, cfg)
    launch = {"launch_pdl": True} if pdl else {}
    _finished_kernel[(math.ceil(n / cfg.block_n), cfg.split)](
        w_desc, x_desc, parts, counts, out if residual is None else residual, out, m, n, scale,
        TILES=tiles_per_split(k, cfg), STAGES=cfg.stages, SPLIT=cfg.split, RESIDUAL=residual is not None, PDL=pdl,
        num_warps=4, maxnreg=MAX_REGISTERS, **launch)
    return out


def partials(x: torch.Tensor, w: torch.Tensor, cfg: GluonConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """float32 [split, M, N] whose sum over dim 0 is x @ w.T (x [M, K] with M <= 16, w [N, K]; rows 16-byte
    aligned). pdl: launched with programmatic dependent launch (a GPU of compute capability >= 9)."""
    check_operands(x, w)
    m, k = x.shape
    n = w.shape[0]
    cfg = cfg or choose_config(n, k)
    out = torch.empty(cfg.split, m, n, device=x.device, dtype=torch.float32)
    w_desc, x_desc = _descriptors(x, w, cfg)
    launch = {"launch_pdl": True} if pdl else {}
    _partials_kernel[(math.ceil(n / cfg.block_n), cfg.split)](
        w_desc, x_desc, out, m, n, TILES=tiles_per_split(k, cfg), STAGES=cfg.stages, PDL=pdl, num_warps=4,
        maxnreg=MAX_REGISTERS, **launch)
    return out
