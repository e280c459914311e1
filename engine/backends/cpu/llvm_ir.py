"""LLVM IR pieces shared by the CPU kernels written as IR intrinsics (simd_dot.py: the decode products'
rows; vnni_tile.py: the prefill products' tiles): the target features numba compiles for, lane masks and
splats, the pairwise lane sums of widened integer products, and pointers into numba arrays.

The kernels that inline those intrinsics key numba's disk cache on this file too (numba_cache_deps.py):
what is built here is compiled into their entries.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types

_I32 = ir.IntType(32)


def target_has(feature: str) -> bool:
    """Whether numba's JIT compiles for `feature` ("avx2", "avx512vnni"): the features numba targets (they key
    its cache), not the host's."""
    from numba.core.registry import cpu_target

    features = getattr(cpu_target.target_context.codegen(), "_tm_features", "") or ""
    return f"+{feature}" in features.split(",")


def lane_mask(values) -> ir.Constant:
    """A shuffle mask: <n x i32> of `values`."""
    return ir.Constant(ir.VectorType(_I32, len(values)), list(values))


def splat(builder, value, vector_type):
    """`vector_type` with `value` in every lane."""
    vec = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, lane_mask([0] * vector_type.count))


def pair_sums(builder, products, lanes: int, width: int):
    """Integer `products` (`lanes` wide) with even and odd lanes added until `width` lanes remain: what
    vpmaddwd / vpdpbusd sum per lane, as plain vector IR for targets without them."""
    while lanes > width:
        products = builder.add(builder.shuffle_vector(products, products, lane_mask(range(0, lanes, 2))),
                               builder.shuffle_vector(products, products, lane_mask(range(1, lanes, 2))))
        lanes //= 2
    return products


def element_pointer(context, builder, array_type, array, index, col=None):
    """(pointer to array[index, col] (col 0 if None; later axes 0), the array's struct)."""
    ary = context.make_array(array_type)(context, builder, array)
    zero = context.get_constant(types.intp, 0)
    idx = [index, zero if col is None else col] + [zero] * (array_type.ndim - 2)
    return cgutils.get_item_pointer(context, builder, array_type, ary, idx[: array_type.ndim]), ary


def row_length(builder, ary):
    """A 2-D array struct's second dimension."""
    return cgutils.unpack_tuple(builder, ary.shape, 2)[1]
