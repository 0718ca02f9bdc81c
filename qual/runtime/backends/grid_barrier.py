"""Grid-wide barriers of a persistent Triton kernel (one program per SM, every program resident): arrive, wait with a
bounded spin (a barrier that does not open is flagged, never a hang), timestamps for benchmarks, and zeroing the
next accumulation buffer between phases. Used by qual/runtime/backends/decode_layers.py."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None


if triton is not None:
    MAX_SPINS = tl.constexpr(1 << 22)  # a barrier that does not open in this many polls gives up and flags it

    @triton.jit
    def _load_acquire(ptr):
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _arrive(flags_ptr, arrivals_ptr, TIMING: tl.constexpr):
        """Count this program in at the barrier (its stores first: bar.sync, then a release atomic); with
        TIMING, stamp when (arrivals_ptr: this program's entry for this barrier)."""
        tl.debug_barrier()
        if TIMING:
            tl.store(arrivals_ptr, _now())
        tl.atomic_add(flags_ptr, 1, sem="release")

    @triton.jit
    def _wait(flags_ptr, timeout_ptr, barrier, times_ptr, POLL_ACQUIRE: tl.constexpr, TIMING: tl.constexpr):
        """Wait until every program has arrived at barrier number `barrier` (1, 2, ... in this launch);
        with TIMING, program 0 then stamps times[barrier].

        Loads issued between _arrive and _wait (the next phase's weights) stream in meanwhile.
        POLL_ACQUIRE: poll with acquire loads (one round trip after the last arrival); else plain
        volatile polls, then one acquire atomic (two)."""
        target = barrier * tl.num_programs(0)
        spins = 0
        if POLL_ACQUIRE:
            while (_load_acquire(flags_ptr) < target) & (spins < MAX_SPINS):
                spins += 1
        else:
            while (tl.load(flags_ptr, volatile=True) < target) & (spins < MAX_SPINS):
                spins += 1
            tl.atomic_add(flags_ptr + 1, 0, sem="acquire")  # what the others wrote before arriving is visible now
        if spins >= MAX_SPINS:
            tl.atomic_max(timeout_ptr, 1)
        tl.debug_barrier()
        if TIMING:
            if tl.program_id(0) == 0:
                tl.store(times_ptr + barrier, _now())

    @triton.jit
    def _zero_next(pid, zero_ptr, H: tl.constexpr, HB: tl.constexpr):
        """Program 0 zeroes the residual buffer the next phase accumulates into."""
        if pid == 0:
            cols = tl.arange(0, HB)
            tl.store(zero_ptr + cols, tl.zeros((HB,), tl.float32), mask=cols < H)
