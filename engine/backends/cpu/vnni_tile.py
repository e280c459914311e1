"""The inner product of a prefill chunk's integer matrix product (cpu/int8_gemm.py) written as LLVM vector IR:
32 weight rows against 1-4 tokens, with AVX-512 VNNI's vpdpbusd where numba compiles for it.

A weight tile is 32 rows unpacked to one unsigned byte per weight in the order vpdpbusd reads them
(int8_gemm.unpack_tile):

    wt[(k / 4) * 128 + r * 4 + k % 4] = q[r, k]          (r < 32 rows; two zmm of 16 rows x 4 bytes per k / 4)
    dt[g * 32 + r], mt[g * 32 + r] = d[r, g], m[r, g]    (w = d q + m per group g of G = 16 or 32 weights)

and a token's activations are int8 (x8[t, k]) with a float scale dx and sum sx = dx * sum_k x8 per group.
Per group g and token t the kernel computes, for 16 rows a vector,

    isum = sum over the group's k / 4 of  vpdpbusd(0, weights[k / 4], broadcast(x8[t, k : k + 4]))  (exact int32)
    acc += float(isum) * (d * dx[t, g]) + m * sx[t, g]

one vpdpbusd per 64 multiply-adds (u8 weights x s8 activations, 4 a lane; LLVM broadcasts the activations
with a separate vpbroadcastd, checked in the asm);
with int16 activations (the decode products' default rounding, 256x finer) the tile holds int16 weights,
2 a lane (wt[(k / 2) * 64 + r * 2 + k % 2]), and vpdpwssd does 32 multiply-adds an instruction;
the 4 tokens' 8 integer and 8 float accumulators stay in registers. A token's operations are the same
whichever tokens share its call, so its result is too (bit-identical to the token alone). The integer sums cannot overflow
(255 * 127 * 32 and 255 * 32767 * 32 < 2^31). Without VNNI the same sums are plain vector IR (zero- and sign-extended products
added in fours), which LLVM lowers to what the target has; tests/test_cpu_int8_gemm.py compares the two.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from engine.backends.cpu.llvm_ir import element_pointer, pair_sums, row_length, splat, target_has

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16I32, _V16F, _V64I8 = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16), ir.VectorType(_I8, 64)
# No fast-math flags on the float part: with contract / reassoc LLVM fused and ordered it differently in the
# 1- and 4-token variants, so a token's result depended on the tokens it was computed with (a batch of
# pipelined groups then changed greedy tokens); plain IEEE mul / add in a fixed order cannot.
_FAST = ()
TILE_ROWS = 32  # rows a tile holds: two vectors of 16
MAX_TOKENS = 4  # tokens one call computes (2 x 4 integer and 2 x 4 float accumulators)
_VECS = TILE_ROWS // 16


def vnni_enabled() -> bool:
    """Whether numba compiles for AVX-512 VNNI (its target features, which key its cache, not the host's)."""
    return target_has("avx512vnni")


def _dot(builder, acc, weights, activations, vnni, wide):
    """acc + per lane the sum of 4 products zext(weight byte) * sext(activation byte) (vpdpbusd), or with
    `wide` of 2 products of int16 weights and activations (vpdpwssd)."""
    if vnni:
        fnty = ir.FunctionType(_V16I32, [_V16I32, _V16I32, _V16I32])
        name = "llvm.x86.avx512.vpdpwssd.512" if wide else "llvm.x86.avx512.vpdpbusd.512"
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), [acc, weights, activations])
    lanes = 32 if wide else 64
    vec, wide_i32 = ir.VectorType(_I16 if wide else _I8, lanes), ir.VectorType(_I32, lanes)
    w = builder.bitcast(weights, vec)
    w = builder.sext(w, wide_i32) if wide else builder.zext(w, wide_i32)
    p = builder.mul(w, builder.sext(builder.bitcast(activations, vec), wide_i32), flags=("nsw",))
    return builder.add(acc, pair_sums(builder, p, lanes, 16))


def _tile_function(module, steps: int, tokens: int, vnni: bool, wide: bool):
    """void fn(wt i8*, dt f32*, mt f32*, x i8*, dx f32*, sx f32*, i64 groups, i64 x_stride, i64 s_stride, y f32*):
    y[t * 32 + r] = row r . token t for the tile's 32 rows and t < tokens; groups of 4 * steps weights;
    token t's activations start x_stride elements (scales: s_stride floats) after token t - 1's; `wide`: int16
    weights and activations, 2 a lane (else bytes, 4 a lane)."""
    name = f"strata_vnni_tile_s{steps}_t{tokens}_{'vnni' if vnni else 'ir'}_{'w16' if wide else 'b8'}"
    try:
        return module.get_global(name)
    except KeyError:
        pass
    f32p = _F32.as_pointer()
    elem = (_I16 if wide else _I8).as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [elem, f32p, f32p, elem, f32p, f32p, _I64, _I64, _I64, f32p])
    fn = ir.Function(module, fnty, name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    wt, dt, mt, x, dx, sx, n_groups, x_stride, s_stride, y = fn.args
    wt_v, dt_v, mt_v = (b.bitcast(p, t.as_pointer()) for p, t in ((wt, _V16I32), (dt, _V16F), (mt, _V16F)))
    at = [ir.Constant(_I64, t) for t in range(tokens)]
    x_rows = [b.bitcast(b.gep(x, [b.mul(t, x_stride)]), _I32.as_pointer()) for t in at]
    dx_rows = [b.gep(dx, [b.mul(t, s_stride)]) for t in at]
    sx_rows = [b.gep(sx, [b.mul(t, s_stride)]) for t in at]
    facc = [[cgutils.alloca_once_value(b, ir.Constant(_V16F, [0.0] * 16)) for _ in range(_VECS)] for _ in at]
    zero = ir.Constant(_V16I32, [0] * 16)
    with cgutils.for_range(b, n_groups) as loop:
        g = loop.index
        isum = [[zero] * _VECS for _ in at]
        for s in range(steps):
            kq = b.add(b.mul(g, ir.Constant(_I64, steps)), ir.Constant(_I64, s))
            w = [b.load(b.gep(wt_v, [b.add(b.mul(kq, ir.Constant(_I64, _VECS)), ir.Constant(_I64, v))]), align=1)
                 for v in range(_VECS)]
            for t in range(tokens):
                xb = splat(b, b.load(b.gep(x_rows[t], [kq]), align=1), _V16I32)
                for v in range(_VECS):
                    isum[t][v] = _dot(b, isum[t][v], w[v], xb, vnni, wide)
        slot = [b.add(b.mul(g, ir.Constant(_I64, _VECS)), ir.Constant(_I64, v)) for v in range(_VECS)]
        d = [b.load(b.gep(dt_v, [i]), align=4) for i in slot]
        m = [b.load(b.gep(mt_v, [i]), align=4) for i in slot]
        for t in range(tokens):
            dxs = splat(b, b.load(b.gep(dx_rows[t], [g])), _V16F)
            sxs = splat(b, b.load(b.gep(sx_rows[t], [g])), _V16F)
            for v in range(_VECS):
                scaled = b.fmul(b.sitofp(isum[t][v], _V16F), b.fmul(d[v], dxs, flags=_FAST), flags=_FAST)
                term = b.fadd(scaled, b.fmul(m[v], sxs, flags=_FAST), flags=_FAST)
                b.store(b.fadd(b.load(facc[t][v]), term, flags=_FAST), facc[t][v])
    y_v = b.bitcast(y, _V16F.as_pointer())
    for t in range(tokens):
        for v in range(_VECS):
            b.store(b.load(facc[t][v]), b.gep(y_v, [ir.Constant(_I64, t * _VECS + v)]), align=4)
    b.ret_void()
    return fn


def tile_kernel(vnni=None):
    """The intrinsic  f(wt, dt, mt, x8, dx, sx, t0, count, yt): yt[t0 + i, :] = the tile's 32 rows . token
    t0 + i for i < count (1 .. MAX_TOKENS; other counts do nothing). wt u8 [K * 32] with x8 int8 [T, K]
    (vpdpbusd), or wt int16 with x8 int16 (vpdpwssd); dt / mt f32 [groups * 32] (unpack_tile's layout);
    dx, sx f32 [T, groups]; yt f32 [T, 32]; all C-contiguous.
    vnni None: vpdpbusd where numba targets AVX-512 VNNI, else plain vector IR; True / False force either."""

    @intrinsic
    def tile_dot(typingctx, wt, dt, mt, x8, dx, sx, t0, count, yt):
        arrays = (wt, dt, mt, x8, dx, sx, yt)
        if not all(isinstance(a, types.Array) and a.layout == "C" for a in arrays):
            raise TypeError("tile_dot takes C-contiguous arrays")
        if (wt.dtype, x8.dtype) not in ((types.uint8, types.int8), (types.int16, types.int16)):
            raise TypeError("tile_dot takes uint8 weights with int8 activations, or int16 with int16")

        def codegen(context, builder, signature, args):
            a = signature.args
            wt_, dt_, mt_, x8_, dx_, sx_, t0_, count_, yt_ = args
            zero = context.get_constant(types.intp, 0)
            t0_ = context.cast(builder, t0_, a[6], types.intp)
            count_ = context.cast(builder, count_, a[7], types.intp)
            wt_p, _ = element_pointer(context, builder, a[0], wt_, zero)
            dt_p, _ = element_pointer(context, builder, a[1], dt_, zero)
            mt_p, _ = element_pointer(context, builder, a[2], mt_, zero)
            x_p, x_ary = element_pointer(context, builder, a[3], x8_, t0_)
            dx_p, dx_ary = element_pointer(context, builder, a[4], dx_, t0_)
            sx_p, _ = element_pointer(context, builder, a[5], sx_, t0_)
            y_p, _ = element_pointer(context, builder, a[8], yt_, t0_)
            n_groups, x_stride = row_length(builder, dx_ary), row_length(builder, x_ary)
            use_vnni = vnni_enabled() if vnni is None else vnni
            wide = a[3].dtype == types.int16
            elem = (_I16 if wide else _I8).as_pointer()
            call_args = [builder.bitcast(wt_p, elem), dt_p, mt_p, builder.bitcast(x_p, elem),
                         dx_p, sx_p, n_groups, x_stride, row_length(builder, dx_ary), y_p]
            per_step = 2 if wide else 4
            steps = builder.udiv(x_stride, builder.mul(n_groups, ir.Constant(_I64, per_step)))  # G / per_step
            done = builder.append_basic_block("tile_done")
            switch = builder.switch(builder.add(builder.mul(steps, ir.Constant(_I64, 16)), count_), done)
            for s in (16 // per_step, 32 // per_step):
                for tokens in range(1, MAX_TOKENS + 1):
                    block = builder.append_basic_block(f"tile_s{s}_t{tokens}")
                    switch.add_case(ir.Constant(_I64, s * 16 + tokens), block)
                    builder.position_at_end(block)
                    builder.call(_tile_function(builder.module, s, tokens, use_vnni, wide), call_args)
                    builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.void(wt, dt, mt, x8, dx, sx, t0, count, yt), codegen

    return tile_dot


tile_dot = tile_kernel()
