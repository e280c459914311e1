"""Row products of repacked weights (int8_repack) and int16 activations (int8_matvec) written as LLVM
vector IR, with x86's multiply-add instruction on CPUs with AVX2.

LLVM did not find vpmaddwd in the numba loops these replace: their nibble products ran 2.4-3.0 Gweights/s
per thread on an AVX2 EPYC, most of a SmolLM2 decode step (9.8-27 now: scripts/bench_decode_kernels.py).
A group of weights is one instruction sequence:

    U4 block (16 bytes, 32 weights): zero-extend to 16 int16, mask the low nibbles / shift out the high ones,
        vpmaddwd each against the block's 16 low-half / 16 high-half activations -> 8 int32 (exact sums)
    U5 block: U4's, with the block's 32-bit word of fifth bits as a <32 x i1> vector (bit j: weight j),
        zero-extended and shifted into bit 4 of each weight first
    U8 group (32 or 16 bytes): zero-extend, vpmaddwd against the group's activations -> 8 int32
    then  acc (8 float32) += float(int32 sums) * (d dx),  offset += (m m_factor) sx  (the weight mins;
          m_factor is 1, or the power of two that makes a symmetric type's d its min: exact)

A row function computes 1-4 tokens (MAX_TOKENS): the groups go in fours, their scales and mins read as
vectors, each group unpacked once for every token, a token's four scaled groups summed in pairs and then
added to its one accumulator (one dependent add per four groups); one horizontal sum per row and token.
The integer sums are exact (255 * 32767 * 4 < 2^31, 31 * 32767 * 4 for U5), so only float32 summation order differs from a plain
dot product; tests/test_cpu_simd_dot.py checks the integer part exactly and the rest against a float64
reference. A token's operations are the same whatever tokens share its call, so a batch's rows are
bit-identical to each token alone.

Float flags are reassoc / contract / nsz, as the numba kernels' fastmath (no nnan / ninf: a non-finite
activation must still make its product NaN). `simd_enabled()` is decided from the features numba compiles
for (a cache entry is keyed on them), not the host's: with NUMBA_CPU_NAME=generic the multiply-add is plain
vector IR, which LLVM lowers to what the target has.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from engine.backends.cpu.llvm_ir import element_pointer, lane_mask, pair_sums, row_length, splat, target_has

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32, _HALF = ir.FloatType(), ir.HalfType()
_V4F, _V8F, _V8I32 = ir.VectorType(_F32, 4), ir.VectorType(_F32, 8), ir.VectorType(_I32, 8)
_V16I16, _V32I16 = ir.VectorType(_I16, 16), ir.VectorType(_I16, 32)
_V16I8, _V32I8 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)
_FAST = ("reassoc", "contract", "nsz")
U4_BLOCK, U5_BLOCK, U8_GROUP32, U8_GROUP16 = "u4", "u5", "u8g32", "u8g16"  # the four group layouts
_NIBBLES = (U4_BLOCK, U5_BLOCK)


def simd_enabled() -> bool:
    """Whether the kernels compile with AVX2 (the features numba's JIT targets include +avx2)."""
    return target_has("avx2")


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
    return pair_sums(builder, products, 16, 8)


def _splat(builder, vector, lane):
    """<8 x float> of vector[lane]."""
    return builder.shuffle_vector(vector, vector, lane_mask([lane] * 8))


def _scales4(builder, base, g0, half):
    """The 4 scales of groups g0 .. g0 + 3 as <4 x float>."""
    if half:
        bits = _load(builder, base, g0, ir.VectorType(_I16, 4))
        return builder.fpext(builder.bitcast(bits, ir.VectorType(_HALF, 4)), _V4F)
    return _load(builder, base, g0, _V4F)


def _hsum(builder, acc, width):
    while width > 1:
        width //= 2
        acc = builder.fadd(builder.shuffle_vector(acc, acc, lane_mask(range(width))),
                           builder.shuffle_vector(acc, acc, lane_mask(range(width, 2 * width))), flags=_FAST)
    return builder.extract_element(acc, ir.Constant(_I32, 0))


class _Row:
    """The state of one row function being generated: its arguments, per-token pointers and accumulators
    (allocas, which LLVM's SROA turns into registers)."""

    def __init__(self, builder, kind, args, tokens):
        self.b, (self.layout, self.half, self.x86) = builder, kind
        qs, qh, d, m, m_factor, xa, xb, dx, sx, self.n_groups, x_stride, s_stride, y, y_stride = args
        self.qs, self.qh, self.d, self.m = qs, qh, d, m
        self.m_factor4 = splat(builder, m_factor, _V4F)
        self.m_factor = m_factor
        at = [ir.Constant(_I64, t) for t in range(tokens)]
        self.xa = [builder.gep(xa, [builder.mul(t, x_stride)]) for t in at]
        self.xb = [builder.gep(xb, [builder.mul(t, x_stride)]) for t in at]
        self.dx = [builder.gep(dx, [builder.mul(t, s_stride)]) for t in at]
        self.sx = [builder.gep(sx, [builder.mul(t, s_stride)]) for t in at]
        self.y = [builder.gep(y, [builder.mul(t, y_stride)]) for t in at]
        zero8, zero4 = ir.Constant(_V8F, [0.0] * 8), ir.Constant(_V4F, [0.0] * 4)
        self.acc = [self._var(_V8F, zero8) for _ in at]
        self.off4 = [self._var(_V4F, zero4) for _ in at]  # m sx of the groups in fours
        self.off1 = [self._var(_F32, ir.Constant(_F32, 0.0)) for _ in at]  # ... of the last n % 4 groups

    def _var(self, ty, value):
        slot = cgutils.alloca_once(self.b, ty)
        self.b.store(value, slot)
        return slot

    def add(self, slot, value):
        self.b.store(self.b.fadd(self.b.load(slot), value, flags=_FAST), slot)

    def weights(self, g):
        """Group g's weights as int16 vectors, unpacked once for every token."""
        b, qs = self.b, self.qs
        if self.layout in _NIBBLES:
            w = b.zext(_load(b, qs, b.mul(g, ir.Constant(_I64, 16)), _V16I8), _V16I16)
            low, high = b.and_(w, ir.Constant(_V16I16, [15] * 16)), b.lshr(w, ir.Constant(_V16I16, [4] * 16))
            if self.layout == U4_BLOCK:
                return low, high
            bits = b.bitcast(b.load(b.gep(self.qh, [g])), ir.VectorType(ir.IntType(1), 32))  # bit j: weight j
            fifth = b.shl(b.zext(bits, _V32I16), ir.Constant(_V32I16, [4] * 32))
            return (b.or_(low, b.shuffle_vector(fifth, fifth, lane_mask(range(16)))),
                    b.or_(high, b.shuffle_vector(fifth, fifth, lane_mask(range(16, 32)))))
        if self.layout == U8_GROUP32:
            w = b.zext(_load(b, qs, b.mul(g, ir.Constant(_I64, 32)), _V32I8), _V32I16)
            return b.shuffle_vector(w, w, lane_mask(range(16))), b.shuffle_vector(w, w, lane_mask(range(16, 32)))
        return (b.zext(_load(b, qs, b.mul(g, ir.Constant(_I64, 16)), _V16I8), _V16I16),)

    def sums(self, weights, g, t):
        """float(exact int32 sums of group g . token t), 8 lanes."""
        b = self.b
        if self.layout in _NIBBLES:
            at = b.mul(g, ir.Constant(_I64, 16))
            x = (_load(b, self.xa[t], at, _V16I16), _load(b, self.xb[t], at, _V16I16))
        elif self.layout == U8_GROUP32:
            at = b.mul(g, ir.Constant(_I64, 32))
            x = (_load(b, self.xa[t], at, _V16I16), _load(b, self.xa[t], b.add(at, ir.Constant(_I64, 16)), _V16I16))
        else:
            x = (_load(b, self.xa[t], b.mul(g, ir.Constant(_I64, 16)), _V16I16),)
        products = [_madd(b, w, v, self.x86) for w, v in zip(weights, x)]
        total = products[0] if len(products) == 1 else b.add(products[0], products[1])
        return b.sitofp(total, _V8F)

    def four_groups(self, g0):
        """Groups g0 .. g0 + 3 for every token: their scales and mins read as vectors of 4."""
        b = self.b
        d4 = _scales4(b, self.d, g0, self.half)
        m4 = b.fmul(_scales4(b, self.m, g0, self.half), self.m_factor4, flags=_FAST)
        s4 = []
        for t in range(len(self.y)):
            s4.append(b.fmul(d4, _load(b, self.dx[t], g0, _V4F), flags=_FAST))
            self.add(self.off4[t], b.fmul(m4, _load(b, self.sx[t], g0, _V4F), flags=_FAST))
        pairs = [[None, None] for _ in self.y]  # per token: groups 0 + 1 and 2 + 3, then one add into acc
        for k in range(4):
            g = b.add(g0, ir.Constant(_I64, k))
            weights = self.weights(g)
            for t in range(len(self.y)):
                scaled = b.fmul(self.sums(weights, g, t), _splat(b, s4[t], k), flags=_FAST)
                pair = pairs[t][k // 2]
                pairs[t][k // 2] = scaled if pair is None else b.fadd(pair, scaled, flags=_FAST)
        for t, (p01, p23) in enumerate(pairs):
            self.add(self.acc[t], b.fadd(p01, p23, flags=_FAST))

    def one_group(self, g):
        b = self.b
        d = _scale(b, self.d, g, self.half)
        m = b.fmul(_scale(b, self.m, g, self.half), self.m_factor, flags=_FAST)
        weights = self.weights(g)
        for t in range(len(self.y)):
            s = b.fmul(d, b.load(b.gep(self.dx[t], [g])), flags=_FAST)
            self.add(self.acc[t], b.fmul(self.sums(weights, g, t), splat(b, s, _V8F), flags=_FAST))
            self.add(self.off1[t], b.fmul(m, b.load(b.gep(self.sx[t], [g])), flags=_FAST))

    def store(self):
        b = self.b
        for t, y in enumerate(self.y):
            total = b.fadd(_hsum(b, b.load(self.acc[t]), 8), _hsum(b, b.load(self.off4[t]), 4), flags=_FAST)
            b.store(b.fadd(total, b.load(self.off1[t]), flags=_FAST), y)


def _row_function(module, kind, tokens):
    """void fn(qs*, qh*, d*, m*, float m_factor, xa*, xb*, dx*, sx*, i64 groups, i64 x_stride, i64 s_stride,
    y*, i64 y_stride):
    y[t * y_stride] = one row . token t for t < tokens (the tokens' activations x_stride / s_stride elements
    apart); kind = (layout, scales are float16 bits, x86's vpmaddwd).

    The groups run in fours (scales and mins loaded as vectors), then the last n % 4 one by one; group g
    always adds into its token's accumulator g % 2 in the same order, whatever `tokens` is, so a token's
    result does not depend on which tokens it was computed with."""
    layout, half, x86 = kind
    name = f"strata_simd_rows_{layout}_{'f16' if half else 'f32'}_{'avx2' if x86 else 'ir'}_t{tokens}"
    try:
        return module.get_global(name)
    except KeyError:
        pass
    scale = (_I16 if half else _F32).as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32.as_pointer(), scale, scale, _F32,
                                           _I16.as_pointer(), _I16.as_pointer(), _F32.as_pointer(),
                                           _F32.as_pointer(), _I64, _I64, _I64, _F32.as_pointer(), _I64])
    fn = ir.Function(module, fnty, name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    row = _Row(builder, kind, fn.args, tokens)
    n_groups = fn.args[9]
    fours = builder.lshr(n_groups, ir.Constant(_I64, 2))
    with cgutils.for_range(builder, fours) as loop:
        row.four_groups(builder.shl(loop.index, ir.Constant(_I64, 2)))
    base = builder.shl(fours, ir.Constant(_I64, 2))
    rest = builder.sub(n_groups, base)
    for k in range(3):
        with builder.if_then(builder.icmp_unsigned(">", rest, ir.Constant(_I64, k))):
            row.one_group(builder.add(base, ir.Constant(_I64, k)))
    row.store()
    builder.ret_void()
    return fn


MAX_TOKENS = 4  # tokens one call computes (the weights' unpacking is shared by them)


def _rows_codegen(layout, x86):
    """codegen of (qs, qh, d, m, m_factor, xa, xb, dx, sx, r, t0, count, y, col): y[t0 + i, col] = row r .
    token t0 + i for i < count (1 .. MAX_TOKENS; other counts do nothing)."""
    def codegen(context, builder, signature, args):
        qs, qh, d, m, m_factor, xa, xb, dx, sx, r, t0, count, y, col = args
        types_ = signature.args
        r, t0, count, col = (context.cast(builder, v, types_[i], types.intp)
                             for i, v in ((9, r), (10, t0), (11, count), (13, col)))
        m_factor = context.cast(builder, m_factor, types_[4], types.float32)
        qs_p, _ = element_pointer(context, builder, types_[0], qs, r)
        qh_p, _ = element_pointer(context, builder, types_[1], qh, r)
        d_p, d_ary = element_pointer(context, builder, types_[2], d, r)
        m_p, _ = element_pointer(context, builder, types_[3], m, r)
        xa_p, xa_ary = element_pointer(context, builder, types_[5], xa, t0)
        xb_p, _ = element_pointer(context, builder, types_[6], xb, t0)
        dx_p, dx_ary = element_pointer(context, builder, types_[7], dx, t0)
        sx_p, _ = element_pointer(context, builder, types_[8], sx, t0)
        y_p, y_ary = element_pointer(context, builder, types_[12], y, t0, col)
        call_args = [qs_p, builder.bitcast(qh_p, _I32.as_pointer()), d_p, m_p, m_factor, xa_p, xb_p, dx_p,
                     sx_p, row_length(builder, d_ary), row_length(builder, xa_ary), row_length(builder, dx_ary),
                     y_p, row_length(builder, y_ary)]
        kind = (layout, types_[2].dtype == types.uint16, simd_enabled() if x86 is None else x86)
        done = builder.append_basic_block("rows_done")
        switch = builder.switch(count, done)
        for tokens in range(1, MAX_TOKENS + 1):
            block = builder.append_basic_block(f"rows_t{tokens}")
            switch.add_case(ir.Constant(count.type, tokens), block)
            builder.position_at_end(block)
            builder.call(_row_function(builder.module, kind, tokens), call_args)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()
    return codegen


def _check(arrays):
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays):
        raise TypeError("simd row products take C-contiguous 2-D arrays")


def row_dots(x86=None):
    """(u4, u5, u8 groups of 32, u8 groups of 16) row-product intrinsics, each

        f(qs, qh, d, m, m_factor, activations..., dx, sx, r, t0, count, y, col):
            y[t0 + i, col] = row r . token t0 + i

    for i < count (1 .. MAX_TOKENS), float32; the weights are an int8_repack.Int8Part's arrays (qh is read
    by u5 alone), the activations int8_matvec's (U4, U5: the xlo, xhi planes and dx, sx; U8 groups of 32:
    x16, dx, sx; of 16 (q6_k): x16, dx16, sx16). x86 None: vpmaddwd where numba targets AVX2, else plain
    vector IR; True / False force either (tests compare the two)."""

    def nibbles(layout):
        codegen = _rows_codegen(layout, x86)

        @intrinsic
        def nibble_rows(typingctx, qs, qh, d, m, m_factor, xlo, xhi, dx, sx, r, t0, count, y, col):
            _check((qs, qh, d, m, xlo, xhi, dx, sx, y))
            return types.void(qs, qh, d, m, m_factor, xlo, xhi, dx, sx, r, t0, count, y, col), codegen
        return nibble_rows

    def u8(layout):
        codegen = _rows_codegen(layout, x86)

        def u8_codegen(context, builder, signature, args):  # x16 passed as both planes (the second unused)
            a = signature.args
            doubled = types.void(*a[:6], a[5], *a[6:])
            return codegen(context, builder, doubled, (*args[:6], args[5], *args[6:]))

        @intrinsic
        def u8_rows(typingctx, qs, qh, d, m, m_factor, x16, dx, sx, r, t0, count, y, col):
            _check((qs, qh, d, m, x16, dx, sx, y))
            return types.void(qs, qh, d, m, m_factor, x16, dx, sx, r, t0, count, y, col), u8_codegen
        return u8_rows

    return nibbles(U4_BLOCK), nibbles(U5_BLOCK), u8(U8_GROUP32), u8(U8_GROUP16)


u4_rows, u5_rows, u8_rows32, u8_rows16 = row_dots()
