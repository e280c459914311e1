"""Atomic work claiming for the one-region decode step (engine/backends/cpu/fused_step.py), in numba.

A step is a fixed sequence of phases (a layer's norm, its QKV rows, its heads, ...); each phase is cut into
units (16-row slices of a product, one head, ...). Every worker of the step's single parallel region walks
the phases in order: it claims units of the current phase with an atomic counter until none are left, then
waits until every claimed unit of that phase is done, and goes on to the next phase.

    counters [n_phases * STRIDE] int64, zeroed before the step: [p * STRIDE] units claimed (may run past
    the phase's count), [p * STRIDE + STRIDE / 2] units done (the two a cache line apart)

Why claiming, not a fixed split with barriers: nothing waits for a worker that has not started or has been
descheduled, so the step cannot deadlock whatever the threading layer does with the region's chunks (one
thread alone runs every unit), and on a shared machine the worker that has a core does the work. Why one
region: libgomp wakes its sleeping threads for every parallel region (`OMP_WAIT_POLICY=PASSIVE`, which
cpu/gguf_row_kernels.py sets because spinning threads stole the cores of a loaded machine), 69 us a region
measured against 2 us spinning; the per-product regions were 121 wake-ups a SmolLM2 token. A wait here
spins with `pause` for a few microseconds, then yields the core (sched_yield / SwitchToThread) each turn;
a phase wait on a quiet machine measured 0.14 us.

The increment is a sequentially consistent read-modify-write and the wait an acquire load, so a unit's
writes are visible to every worker that has seen it counted done (LLVM's atomics: correct on x86 and ARM).
"""
from __future__ import annotations

import ctypes
import platform
import sys

from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

STRIDE = 16  # int64s per phase: the claim counter and the done counter on different cache lines
_SPINS_BEFORE_YIELD = 64
_YIELD_SYMBOL = "strata_cpu_yield"


def _register_yield() -> None:
    """Make `strata_cpu_yield` resolve, in every process, to the OS call that gives up the core."""
    if sys.platform == "win32":
        fn = ctypes.windll.kernel32.SwitchToThread
    else:
        fn = ctypes.CDLL(None).sched_yield
    llvm.add_symbol(_YIELD_SYMBOL, ctypes.cast(fn, ctypes.c_void_p).value)


_register_yield()
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _element_pointer(context, builder, array_type, array, index):
    ary = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [index])


@intrinsic
def atomic_add(typingctx, counters, index, value):
    """counters[index] += value atomically (seq_cst); returns the value before."""
    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")
    return types.int64(counters, types.intp, types.int64), codegen


@intrinsic
def atomic_load(typingctx, counters, index):
    """counters[index], an acquire load."""
    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)
    return types.int64(counters, types.intp), codegen


@intrinsic
def cpu_relax(typingctx):
    """A spin-wait hint (x86 `pause`; nothing elsewhere)."""
    def codegen(context, builder, signature, args):
        if _X86:  # LLVM's intrinsic: numba's JIT has no assembler for inline asm
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def cpu_yield(typingctx):
    """Give up the core to another runnable thread (sched_yield / SwitchToThread)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), _YIELD_SYMBOL)
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(cache=True)
def claim(counters, phase, n_units):
    """The next unclaimed unit of `phase` (0 .. n_units - 1), or -1 when all are taken."""
    unit = atomic_add(counters, phase * STRIDE, 1)
    return unit if unit < n_units else -1


@njit(cache=True)
def claim_end(counters, phase, n_units, from_back):
    """claim, but the units are handed out from both ends: workers taking from the front get 0, 1, 2, ...,
    those taking from the back n - 1, n - 2, ..., so two workers each stream one contiguous half of a
    product's rows until they meet (interleaved 16-row units broke every worker's stream into 4.6 KB runs)."""
    if atomic_add(counters, phase * STRIDE, 1) >= n_units:
        return -1
    if from_back:
        return n_units - 1 - atomic_add(counters, phase * STRIDE + 2, 1)
    return atomic_add(counters, phase * STRIDE + 1, 1)


@njit(cache=True)
def unit_done(counters, phase):
    """Count one unit of `phase` done (after its writes)."""
    atomic_add(counters, phase * STRIDE + STRIDE // 2, 1)


@njit(cache=True)
def wait_phase(counters, phase, n_units):
    """Return once all n_units of `phase` are done: spin briefly, then yield the core between looks."""
    spins = 0
    while atomic_load(counters, phase * STRIDE + STRIDE // 2) < n_units:
        if spins < _SPINS_BEFORE_YIELD:
            cpu_relax()
            spins += 1
        else:
            cpu_yield()
