"""float16 in numba kernels, as its bits (uint16): numba has no float16 type, LLVM has `half`.

    as_float(value) -> float32          a float32 as is; uint16 bits widened (exact)
    kv_store(value, pool_dtype_value)   float32 -> the pool's type: float32 as is; uint16 = the float16 nearest,
                                        ties to even (LLVM's fptrunc), the rounding numpy's astype(float16) does

so the fused decode step (cpu/fused_step.py) reads and writes a float16 K/V pool through a uint16 view of it
with the bytes the unfused path (engine/kv_quant.py, numpy) would write. On x86 with F16C LLVM emits
vcvtph2ps / vcvtps2ph (checked in tests/test_cpu_half.py against numpy for every one of the 65536 values).
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload


@intrinsic
def half_to_float(typingctx, bits):
    """float16 bits (uint16) -> float32, exact."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def float_to_half(typingctx, value):
    """float32 -> float16 bits (uint16), rounded to nearest, ties to even."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


def as_float(value):
    """A float32 as is, float16 bits (uint16) widened (exact): a K/V pool element or a repacked weight scale
    (jitted code only)."""
    raise NotImplementedError("called from jitted code only")


@overload(as_float, jit_options={"cache": True})
def _as_float_typed(value):
    if value == types.uint16:
        return lambda value: half_to_float(value)
    return lambda value: value


def kv_store(value, like):
    """float32 value in the type of `like`, a K/V pool element (jitted code only)."""
    raise NotImplementedError("called from jitted code only")


@overload(kv_store, jit_options={"cache": True})
def _kv_store_typed(value, like):
    if like == types.uint16:
        return lambda value, like: float_to_half(value)
    return lambda value, like: value
