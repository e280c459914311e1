"""GGUF block decoders for the CPU kernels: one row of raw blocks -> float32, in numba.

Each decoder follows ggml's `dequantize_row_*` (ggml-quants.c) and the `gguf` package's numpy port
(`gguf.quants`), which tests/test_cpu_quant_kernels.py checks it against for every type. A row is a
uint8 array of whole blocks; float16 scales are read through a 65536-entry table (`f16_table`) because
numba has no float16 scalar type on the CPU. Every inner loop runs over 16 or 32 lanes without branches,
with the 16 passed at run time (`lanes`, see gguf_row_kernels._LANES), so LLVM turns it into SIMD code.
The kernel modules that call these decoders key their numba cache entries on this file's source too
(engine/backends/cpu/numba_cache_deps.py), so an edit here recompiles them.

Block layouts (bytes; d, m = float16 scale and offset):

    q4_0  18: d | qs[16]                 w = d * (nibble - 8)          low nibbles are 0..15, high 16..31
    q4_1  20: d | m | qs[16]             w = d * nibble + m
    q5_0  22: d | qh[4] | qs[16]         w = d * (nibble | bit << 4) - 16 d
    q5_1  24: d | m | qh[4] | qs[16]     w = d * (nibble | bit << 4) + m
    q8_0  34: d | qs[32] (int8)          w = d * q
    q4_k 144: d | dmin | scales[12] | qs[128]            8 sub-blocks of 32, 6-bit scale and min each
    q5_k 176: d | dmin | scales[12] | qh[32] | qs[128]   q4_k plus a fifth bit per weight
    q6_k 210: ql[128] | qh[64] | scales[16] (int8) | d   16 sub-blocks of 16
    mxfp4 17: e (e8m0) | qs[16]          w = 2^(e - 128) * kvalue[nibble]    (gpt-oss experts; kvalues are
                                         OCP's e2m1 doubled, so the scale is halved: gguf's e8m0_to_fp32_half)
"""
from __future__ import annotations

import numpy as np
from numba import njit

_F32 = np.float32
# Typed constants: numba types a Python int literal as int64, and `q & 0xF` on int32 / uint8 lanes then
# widened every lane to 64 bits (half the SIMD width; measured 4.6 -> 6 Gweights/s per thread on q4_1).
_U8, _U32, _I32 = np.uint8, np.uint32, np.int32
_LOW4, _SH4, _ONE, _TWO = _U8(15), _U8(4), _U8(1), _U8(2)
_I2, _I3, _I4, _I6, _I15, _I32_OFF = _I32(2), _I32(3), _I32(4), _I32(6), _I32(15), _I32(32)
# Integer ids of the types the kernels decode (a jitted function dispatches on an int, not an enum).
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 = range(12)
# MXFP4: e2m1 values doubled (gguf.quants.MXFP4.kvalues) and the halved e8m0 scale of every exponent byte
# (2^(e - 128), exact in float32 down to the subnormal 2^-128); numba keeps global arrays as constants.
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
_E8M0_HALF = np.ldexp(1.0, np.arange(256) - 128).astype(np.float32)


def f16_table() -> np.ndarray:
    """float32 value of every float16 bit pattern, indexed by the pattern."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(inline="always", cache=True)
def _half(row, offset, table):
    return table[np.int32(row[offset]) | (np.int32(row[offset + 1]) << 8)]


@njit(inline="always", cache=True)
def _scale_min_k4(j, scales, offset):
    """The 6-bit scale and min of sub-block j of a q4_k / q5_k block (ggml's get_scale_min_k4)."""
    if j < 4:
        sc = np.int32(scales[offset + j]) & 63
        mn = np.int32(scales[offset + j + 4]) & 63
    else:
        sc = (np.int32(scales[offset + j + 4]) & 0xF) | ((np.int32(scales[offset + j - 4]) >> 6) << 4)
        mn = (np.int32(scales[offset + j + 4]) >> 4) | ((np.int32(scales[offset + j]) >> 6) << 4)
    return sc, mn


@njit(inline="always", cache=True)
def _q4_0(row, w, table, lanes):
    for b in range(w.size // 32):
        o, base = b * 18, b * 32
        d = _half(row, o, table)
        for j in range(lanes):
            q = row[o + 2 + j]
            w[base + j] = d * (_F32(q & _LOW4) - _F32(8.0))  # small integers: exact either way
            w[base + j + 16] = d * (_F32(q >> _SH4) - _F32(8.0))


@njit(inline="always", cache=True)
def _q4_1(row, w, table, lanes):
    for b in range(w.size // 32):
        o, base = b * 20, b * 32
        d, m = _half(row, o, table), _half(row, o + 2, table)
        for j in range(lanes):
            q = row[o + 4 + j]
            w[base + j] = d * _F32(q & _LOW4) + m
            w[base + j + 16] = d * _F32(q >> _SH4) + m


@njit(inline="always", cache=True)
def _q5(row, w, table, has_min, lanes):
    size = 24 if has_min else 22
    for b in range(w.size // 32):
        o, base = b * size, b * 32
        d = _half(row, o, table)
        m = _half(row, o + 2, table) if has_min else _F32(-16.0) * d
        h = o + 4 if has_min else o + 2
        qh = (_U32(row[h]) | (_U32(row[h + 1]) << _U32(8)) | (_U32(row[h + 2]) << _U32(16))
              | (_U32(row[h + 3]) << _U32(24)))
        for j in range(lanes):
            q = row[h + 4 + j]
            lo = _U32(q & _LOW4) | (((qh >> _U32(j)) & _U32(1)) << _U32(4))
            hi = _U32(q >> _SH4) | (((qh >> _U32(j + 16)) & _U32(1)) << _U32(4))
            w[base + j] = d * _F32(lo) + m
            w[base + j + 16] = d * _F32(hi) + m


@njit(inline="always", cache=True)
def _q8_0(row, w, table, lanes):
    for b in range(w.size // 32):
        o, base = b * 34, b * 32
        d = _half(row, o, table)
        for j in range(2 * lanes):
            w[base + j] = d * _F32(np.int8(row[o + 2 + j]))


@njit(inline="always", cache=True)
def _qk45(row, w, table, five_bits, lanes):
    """q4_k (five_bits False) and q5_k: 4 pairs of 32-weight sub-blocks per 256-weight block."""
    size = 176 if five_bits else 144
    for b in range(w.size // 256):
        o, base = b * size, b * 256
        d, dmin = _half(row, o, table), _half(row, o + 2, table)
        qs = o + 48 if five_bits else o + 16
        for pair in range(4):
            sc1, m1 = _scale_min_k4(2 * pair, row, o + 4)
            sc2, m2 = _scale_min_k4(2 * pair + 1, row, o + 4)
            d1, d2 = d * _F32(sc1), d * _F32(sc2)
            n1, n2 = dmin * _F32(m1), dmin * _F32(m2)
            for j in range(2 * lanes):
                q = row[qs + pair * 32 + j]
                lo, hi = q & _LOW4, q >> _SH4
                if five_bits:
                    bits = row[o + 16 + j] >> _U8(2 * pair)
                    lo += (bits & _ONE) << _SH4
                    hi += (bits & _TWO) << _U8(3)
                w[base + pair * 64 + j] = d1 * _F32(lo) - n1
                w[base + pair * 64 + 32 + j] = d2 * _F32(hi) - n2


@njit(inline="always", cache=True)
def _q6_k(row, w, table, lanes):
    for b in range(w.size // 256):
        o, base = b * 210, b * 256
        d = _half(row, o + 208, table)
        for half in range(2):
            ql, qh, sc = o + half * 64, o + 128 + half * 32, o + 192 + half * 8
            for s in range(2):  # the 16-weight sub-blocks: scales sc[s], sc[s + 2], sc[s + 4], sc[s + 6]
                d1, d2 = d * _F32(np.int8(row[sc + s])), d * _F32(np.int8(row[sc + s + 2]))
                d3, d4 = d * _F32(np.int8(row[sc + s + 4])), d * _F32(np.int8(row[sc + s + 6]))
                out = base + half * 128 + s * lanes
                for j in range(lanes):
                    k = s * lanes + j
                    h = _I32(row[qh + k])
                    a, c = _I32(row[ql + k]), _I32(row[ql + 32 + k])
                    w[out + j] = d1 * _F32(((a & _I15) | ((h & _I3) << _I4)) - _I32_OFF)
                    w[out + 32 + j] = d2 * _F32(((c & _I15) | (((h >> _I2) & _I3) << _I4)) - _I32_OFF)
                    w[out + 64 + j] = d3 * _F32(((a >> _I4) | (((h >> _I4) & _I3) << _I4)) - _I32_OFF)
                    w[out + 96 + j] = d4 * _F32(((c >> _I4) | (((h >> _I6) & _I3) << _I4)) - _I32_OFF)


@njit(inline="always", cache=True)
def _mxfp4(row, w, lanes):
    for b in range(w.size // 32):
        o, base = b * 17, b * 32
        d = _E8M0_HALF[np.int32(row[o])]
        for j in range(lanes):
            q = np.int32(row[o + 1 + j])
            w[base + j] = d * _MXFP4_VALUES[q & 0xF]
            w[base + j + 16] = d * _MXFP4_VALUES[q >> 4]


@njit(inline="always", cache=True)
def decode_row(kind, row, w, table, w_bits, lanes):
    """Decode one row of type `kind` (raw uint8 bytes) into w (float32 [in_dim]); w_bits is w's uint32 view."""
    if kind == Q4_0:
        _q4_0(row, w, table, lanes)
    elif kind == Q4_1:
        _q4_1(row, w, table, lanes)
    elif kind == Q5_0:
        _q5(row, w, table, False, lanes)
    elif kind == Q5_1:
        _q5(row, w, table, True, lanes)
    elif kind == Q8_0:
        _q8_0(row, w, table, lanes)
    elif kind == Q4_K:
        _qk45(row, w, table, False, lanes)
    elif kind == Q5_K:
        _qk45(row, w, table, True, lanes)
    elif kind == Q6_K:
        _q6_k(row, w, table, lanes)
    elif kind == MXFP4:
        _mxfp4(row, w, lanes)
    elif kind == BF16:  # the float32 with the same top 16 bits
        for i in range(w.size):
            w_bits[i] = (np.uint32(row[2 * i]) << 16) | (np.uint32(row[2 * i + 1]) << 24)
    elif kind == F16:
        for i in range(w.size):
            w[i] = table[np.int32(row[2 * i]) | (np.int32(row[2 * i + 1]) << 8)]
    else:  # F32: the bytes are the floats
        for i in range(w.size):
            w_bits[i] = (np.uint32(row[4 * i]) | (np.uint32(row[4 * i + 1]) << 8) | (np.uint32(row[4 * i + 2]) << 16)
                         | (np.uint32(row[4 * i + 3]) << 24))
