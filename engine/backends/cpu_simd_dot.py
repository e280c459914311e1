"""Row products of repacked weights (cpu_int8_repack) and int16 activations (cpu_int8_matvec) written as LLVM
vector IR with x86's multiply-add instruction, for CPUs with AVX2.

LLVM did not find vpmaddwd in the numba loops: their nibble products ran 2.4 Gweights/s per thread on an
AVX2 EPYC, most of a SmolLM2 decode step. Here a group of weights is one instruction sequence:

    U4 block (16 bytes, 32 weights): zero-extend to 16 int16, mask the low nibbles / shift out the high ones,
        vpmaddwd each against the block's 16 low-half / 16 high-half activations -> 8 int32 (exact sums)
    U8 group (32 or 16 bytes): zero-extend, vpmaddwd against the group's activations -> 8 int32
    then  acc (8 float32) += float(int32 sums) * (d * dx);  offset += m * sx  (the weight mins)

with two accumulators (even and odd groups) so consecutive groups' float adds do not wait on each other, and
one horizontal sum per row. The integer sums are exact (255 * 32767 * 4 < 2^31), so the result differs from
the numba loops' (cpu_int8_matvec._dot_*_loop) only in float32 summation order; tests/test_cpu_simd_dot.py
checks the integer part exactly and the rest against them. Every token of a batch runs the same function,
so a batch's rows stay bit-identical to each token alone.

`simd_enabled()` is decided from the features numba compiles for (a cache entry is keyed on them), not the
host's: NUMBA_CPU_NAME=generic gets the loops.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32, _HALF = ir.FloatType(), ir.HalfType()
_V8F, _V8I32 = ir.VectorType(_F32, 8), ir.VectorType(_I32, 8)
_V16I16, _V32I16 = ir.VectorType(_I16, 16), ir.VectorType(_I16, 32)
_V16I8, _V32I8 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)
_FAST = ("fast",)
U4_BLOCK, U8_GROUP32, U8_GROUP16 = "u4", "u8g32", "u8g16"  # the three group layouts


def simd_enabled() -> bool:
    """Whether the kernels compile with AVX2 (the features numba's JIT targets include +avx2)."""
    from numba.core.registry import cpu_target

    features = getattr(cpu_target.target_context.codegen(), "_tm_features", "") or ""
    return "+avx2" in features.split(",")


def _mask(values):
    return ir.Constant(ir.VectorType(_I32, len(values)), list(values))


def _load(builder, base, index, vector_type):
    """vector_type's worth of elements at base[index] (unaligned)."""
    ptr = builder.bitcast(builder.gep(base, [index]), vector_type.as_pointer())
    return builder.load(ptr, align=1)


def _scale(builder, base, index, half):
    value = builder.load(builder.gep(base, [index]))
    return builder.fpext(builder.bitcast(value, _HALF), _F32) if half else value


def _madd(builder, weights, activations, x86):
    """8 int32: weights[2k] activations[2k] + weights[2k + 1] activations[2k + 1] (vpmaddwd). Without AVX2
    the same as plain vector IR, which LLVM lowers to the target's own multiply-adds (on this AVX2 machine it
    found vpmaddwd in it too: 9.7 against 10.1 Gweights/s)."""
    if x86:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8I32, [_V16I16, _V16I16]),
                                            "llvm.x86.avx2.pmadd.wd")
        return builder.call(fn, [weights, activations])
    v16 = ir.VectorType(_I32, 16)
    products = builder.mul(builder.sext(weights, v16), builder.sext(activations, v16), flags=("nsw",))
    return builder.add(builder.shuffle_vector(products, products, _mask(range(0, 16, 2))),
                       builder.shuffle_vector(products, products, _mask(range(1, 16, 2))))


def _group_sums(builder, layout, x86, qs, xa, xb, g):
    """The exact int32 sums (8 lanes) of group g: weights times int16 activations."""
    if layout == U4_BLOCK:
        w = builder.zext(_load(builder, qs, builder.mul(g, ir.Constant(_I64, 16)), _V16I8), _V16I16)
        low = builder.and_(w, ir.Constant(_V16I16, [15] * 16))
        high = builder.lshr(w, ir.Constant(_V16I16, [4] * 16))
        at = builder.mul(g, ir.Constant(_I64, 16))
        return builder.add(_madd(builder, low, _load(builder, xa, at, _V16I16), x86),
                           _madd(builder, high, _load(builder, xb, at, _V16I16), x86))
    if layout == U8_GROUP32:
        at = builder.mul(g, ir.Constant(_I64, 32))
        w = builder.zext(_load(builder, qs, at, _V32I8), _V32I16)
        x = _load(builder, xa, at, _V32I16)
        halves = [_mask(range(16)), _mask(range(16, 32))]
        return builder.add(*[_madd(builder, builder.shuffle_vector(w, w, h), builder.shuffle_vector(x, x, h),
                                   x86) for h in halves])
    at = builder.mul(g, ir.Constant(_I64, 16))
    w = builder.zext(_load(builder, qs, at, _V16I8), _V16I16)
    return _madd(builder, w, _load(builder, xa, at, _V16I16), x86)


def _splat(builder, value):
    vec = builder.insert_element(ir.Constant(_V8F, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, _mask([0] * 8))


def _accumulate(builder, kind, args, g, acc, offset):
    """acc + float(sums of group g) * (d dx), offset + m sx."""
    layout, half, x86 = kind
    qs, d, m, xa, xb, dx, sx, _ = args
    sums = builder.sitofp(_group_sums(builder, layout, x86, qs, xa, xb, g), _V8F)
    s = builder.fmul(_scale(builder, d, g, half), builder.load(builder.gep(dx, [g])), flags=_FAST)
    acc = builder.fadd(acc, builder.fmul(sums, _splat(builder, s), flags=_FAST), flags=_FAST)
    o = builder.fmul(_scale(builder, m, g, half), builder.load(builder.gep(sx, [g])), flags=_FAST)
    return acc, builder.fadd(offset, o, flags=_FAST)


def _horizontal_sum(builder, acc):
    for width in (4, 2, 1):
        acc = builder.fadd(builder.shuffle_vector(acc, acc, _mask(range(width))),
                           builder.shuffle_vector(acc, acc, _mask(range(width, 2 * width))), flags=_FAST)
    return builder.extract_element(acc, ir.Constant(_I32, 0))


def _row_function(module, kind):
    """float fn(qs*, d*, m*, xa*, xb*, dx*, sx*, i64 groups): one row dotted with one token's activations;
    kind = (layout, scales are float16 bits, x86's vpmaddwd)."""
    layout, half, x86 = kind
    name = f"strata_simd_row_{layout}_{'f16' if half else 'f32'}_{'avx2' if x86 else 'ir'}"
    try:
        return module.get_global(name)
    except KeyError:
        pass
    scale = _I16 if half else _F32
    fnty = ir.FunctionType(_F32, [_I8.as_pointer(), scale.as_pointer(), scale.as_pointer(), _I16.as_pointer(),
                                  _I16.as_pointer(), _F32.as_pointer(), _F32.as_pointer(), _I64])
    fn = ir.Function(module, fnty, name)
    fn.linkage = "internal"
    args = fn.args
    n_groups = args[7]
    entry, head, body, tail_check, tail, done = [fn.append_basic_block(b) for b in
                                                 ("entry", "head", "body", "tail_check", "tail", "done")]
    builder = ir.IRBuilder(entry)
    zero_acc, zero = ir.Constant(_V8F, [0.0] * 8), ir.Constant(_F32, 0.0)
    pairs = builder.lshr(n_groups, ir.Constant(_I64, 1))
    builder.branch(head)

    builder.position_at_end(head)
    i = builder.phi(_I64)
    acc0, acc1, offset = builder.phi(_V8F), builder.phi(_V8F), builder.phi(_F32)
    for phi, start in ((i, ir.Constant(_I64, 0)), (acc0, zero_acc), (acc1, zero_acc), (offset, zero)):
        phi.add_incoming(start, entry)
    builder.cbranch(builder.icmp_unsigned("<", i, pairs), body, tail_check)

    builder.position_at_end(body)  # groups 2i and 2i + 1 into the two accumulators
    g0 = builder.shl(i, ir.Constant(_I64, 1))
    next0, off0 = _accumulate(builder, kind, args, g0, acc0, offset)
    next1, off1 = _accumulate(builder, kind, args, builder.add(g0, ir.Constant(_I64, 1)), acc1, off0)
    for phi, value in ((i, builder.add(i, ir.Constant(_I64, 1))), (acc0, next0), (acc1, next1), (offset, off1)):
        phi.add_incoming(value, body)
    builder.branch(head)

    builder.position_at_end(tail_check)  # an odd group count: the last group alone
    odd = builder.trunc(n_groups, ir.IntType(1))
    builder.cbranch(odd, tail, done)
    builder.position_at_end(tail)
    last_acc, last_off = _accumulate(builder, kind, args, builder.sub(n_groups, ir.Constant(_I64, 1)),
                                     acc0, offset)
    builder.branch(done)

    builder.position_at_end(done)
    acc_end, off_end = builder.phi(_V8F), builder.phi(_F32)
    acc_end.add_incoming(acc0, tail_check)
    acc_end.add_incoming(last_acc, tail)
    off_end.add_incoming(offset, tail_check)
    off_end.add_incoming(last_off, tail)
    total = _horizontal_sum(builder, builder.fadd(acc_end, acc1, flags=_FAST))
    builder.ret(builder.fadd(total, off_end, flags=_FAST))
    return fn


def _row_pointer(context, builder, array_type, array, row):
    ary = context.make_array(array_type)(context, builder, array)
    zero = context.get_constant(types.intp, 0)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [row, zero]), ary


def _row_dot_codegen(layout, x86):
    def codegen(context, builder, signature, args):
        qs, d, m, xa, xb, dx, sx, r, t = args
        qs_t, d_t, m_t, xa_t, xb_t, dx_t, sx_t, r_t, t_t = signature.args
        r = context.cast(builder, r, r_t, types.intp)
        t = context.cast(builder, t, t_t, types.intp)
        qs_p, _ = _row_pointer(context, builder, qs_t, qs, r)
        d_p, d_ary = _row_pointer(context, builder, d_t, d, r)
        m_p, _ = _row_pointer(context, builder, m_t, m, r)
        xa_p, _ = _row_pointer(context, builder, xa_t, xa, t)
        xb_p, _ = _row_pointer(context, builder, xb_t, xb, t)
        dx_p, _ = _row_pointer(context, builder, dx_t, dx, t)
        sx_p, _ = _row_pointer(context, builder, sx_t, sx, t)
        n_groups = cgutils.unpack_tuple(builder, d_ary.shape, 2)[1]
        kind = (layout, d_t.dtype == types.uint16, simd_enabled() if x86 is None else x86)
        fn = _row_function(builder.module, kind)
        return builder.call(fn, [qs_p, d_p, m_p, xa_p, xb_p, dx_p, sx_p, n_groups])
    return codegen


def _check(arrays):
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays):
        raise TypeError("simd row products take C-contiguous 2-D arrays")


def _u8_codegen(layout, x86):
    """A U8 product's codegen: its one activation array passed as both of U4's (xlo, xhi; the second unused)."""
    codegen = _row_dot_codegen(layout, x86)

    def u8(context, builder, signature, args):
        a = signature.args
        doubled = types.float32(a[0], a[1], a[2], a[3], a[3], a[4], a[5], a[6], a[7])
        return codegen(context, builder, doubled, (*args[:4], args[3], *args[4:]))
    return u8


def row_dots(x86=None):
    """(u4, u8 groups of 32, u8 groups of 16) row-product intrinsics; x86 None: vpmaddwd where numba targets
    AVX2, else plain vector IR; True / False force either (tests compare the two)."""

    @intrinsic
    def u4_row_dot(typingctx, qs, d, m, xlo, xhi, dx, sx, r, t):
        """Row r of a U4 part . token t (cpu_int8_matvec's activation planes xlo / xhi, dx, sx), float32."""
        _check((qs, d, m, xlo, xhi, dx, sx))
        return types.float32(qs, d, m, xlo, xhi, dx, sx, r, t), _row_dot_codegen(U4_BLOCK, x86)

    @intrinsic
    def u8_row_dot32(typingctx, qs, d, m, x16, dx, sx, r, t):
        """Row r of a U8 part with groups of 32 . token t (x16, dx, sx), float32."""
        _check((qs, d, m, x16, dx, sx))
        return types.float32(qs, d, m, x16, dx, sx, r, t), _u8_codegen(U8_GROUP32, x86)

    @intrinsic
    def u8_row_dot16(typingctx, qs, d, m, x16, dx16, sx16, r, t):
        """Row r of a U8 part with groups of 16 (q6_k) . token t (x16, dx16, sx16), float32."""
        _check((qs, d, m, x16, dx16, sx16))
        return types.float32(qs, d, m, x16, dx16, sx16, r, t), _u8_codegen(U8_GROUP16, x86)

    return u4_row_dot, u8_row_dot32, u8_row_dot16


u4_row_dot, u8_row_dot32, u8_row_dot16 = row_dots()
