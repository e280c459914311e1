"""GGUF rows repacked at load for the int8-activation decode products (engine/backends/cpu/int8_matvec.py).

Every supported type becomes one of three planar forms, the integers in their own arrays and the float
scales in theirs (float32, or float16 bits for HALF_SCALE_TYPES when a model's every linear allows it), so
the kernels' inner loops read contiguous bytes and no float16 table:

    U4   qs [R, in/2] u8, d [R, in/32]                 w = d * nibble + m                   q4_0, q4_1, q4_k
    U5   U4's qs, qh [R, in/32] u32, d [R, in/32]      w = d * (nibble + 16 * bit) + m      q5_0, q5_1, q5_k
    U8   qs [R, in] u8, d [R, in/G]                    w = d * byte + m                     q8_0 (byte = q + 128),
                                                                                             q6_k (G = 16)

In U4 and U5 byte j of a 32-weight block holds weight j in its low nibble and weight j + 16 in its high one
(the q4_0 / q4_1 layout); in U5 bit j of the block's qh word is weight j's fifth bit (the q5_0 / q5_1
layout). The k-quants' 6-bit sub-block scales and mins are multiplied out into d and m (d = d_super * sc,
m = -dmin_super * mn, each a float32 product as ggml's dequantisation does it).

The mins: `m * m_factor` per group. Types with mins of their own (q4_1, q5_1, q4_k, q5_k) store them in m
(m_factor 1). The symmetric types' mins are a power of two times d (q4_0 -8 d, q5_0 -16 d, q6_k -32 d, q8_0
-128 d): their m is d itself, not stored twice, and m_factor the power of two, so every product is what the
stored mins gave (a power-of-two factor is exact in float32), and the float16 scales need no range check.

Bytes per 32 weights (float32 / float16 scales; the file's in brackets): q4_0 20 / 18 (18), q4_1 24 / 20 (20),
q5_0 24 / 22 (22), q5_1 28 / 24 (24), q8_0 36 / 34 (34); float32 only: q4_k 24 (18), q5_k 28 (22), q6_k 40
(26.25). The fifth bits stay a
plane of bits: widened to a byte a weight (the earlier U8 form of q5_0) they made Qwen2.5-Coder-0.5B's
linears 40 bytes a group against the file's 22. Unsigned integers with the offset moved into m: LLVM's
products of zero-extended bytes ran at 8.4 Gweights/s, of sign-extended int8 at 7.2 (one thread, SmolLM2's
49152 x 576 head). `unpack` is checked against gguf.quants' dequantisation in tests/test_cpu_int8_matvec.py
for every type.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from engine.quant_types import HALF_SCALE_TYPES, INT8_TYPES  # the types repacked; those with float16 scales

U4, U8, U5 = 0, 1, 2  # forms (a jitted function dispatches on an int)
REPACK_ROWS = 4096


class Int8Part(NamedTuple):
    """One repacked part; the tuple (form, qs, qh, d, m, m_factor) is what the kernels take. Arrays read-only."""
    form: int
    qs: np.ndarray  # uint8 [R, in/2] (U4, U5) or [R, in] (U8)
    qh: np.ndarray  # uint32 [R, in/32]: U5's fifth bits; [R, 0] in the other forms
    d: np.ndarray   # float32 [R, in/G]: G = 32 (U4, U5, U8) or 16 (U8 of q6_k); or float16 bits (uint16)
    m: np.ndarray   # d's shape and type: the mins, or d itself (the symmetric types)
    m_factor: np.float32  # the group's min is m * m_factor


# the symmetric types' mins as a multiple of d (the offset of their stored unsigned integers)
_MIN_PER_D = {Q.Q4_0: -8.0, Q.Q5_0: -16.0, Q.Q6_K: -32.0, Q.Q8_0: -128.0}
_FORMS = {Q.Q4_0: U4, Q.Q4_1: U4, Q.Q4_K: U4, Q.Q5_0: U5, Q.Q5_1: U5, Q.Q5_K: U5, Q.Q8_0: U8, Q.Q6_K: U8}


def empty_part(half_scales: bool = False) -> Int8Part:
    """The absent second part of a one-part linear (0 rows, the same array types)."""
    scale = np.zeros((0, 1), np.uint16 if half_scales else np.float32)
    return _frozen(Int8Part(U4, np.zeros((0, 16), np.uint8), np.zeros((0, 1), np.uint32), scale, scale,
                            np.float32(1.0)))


def repack(tensor_type: Q, rows: np.ndarray, in_dim: int, half_scales: bool = False) -> Int8Part:
    """Raw GGUF rows [R, row_bytes] of `tensor_type` -> an Int8Part (new arrays; `rows` is not kept).

    half_scales: d and m as float16 bits (uint16, half.as_float in the kernels), 2 or 4 bytes a group fewer;
    only for HALF_SCALE_TYPES, whose scales and mins are float16 in the file (the symmetric types' mins are
    m_factor times d). In chunks of REPACK_ROWS rows: the numpy temporaries of a whole tensor at once raised
    gemma3's peak RSS by 800 MiB for its 262144-row head (measured), a chunk's by a few MiB."""
    if half_scales and tensor_type not in HALF_SCALE_TYPES:
        raise ValueError(f"{tensor_type.name} scales are not float16 in the file")
    n_rows = rows.shape[0]
    first = _repack_rows(tensor_type, rows[:REPACK_ROWS], in_dim, half_scales)
    if n_rows <= REPACK_ROWS:
        return _frozen(first)
    arrays = {name: np.empty((n_rows, a.shape[1]), a.dtype) for name, a in _arrays(first).items()}
    for start in range(0, n_rows, REPACK_ROWS):
        chunk = first if start == 0 else _repack_rows(tensor_type, rows[start : start + REPACK_ROWS], in_dim,
                                                      half_scales)
        for name, src in _arrays(chunk).items():
            arrays[name][start : start + src.shape[0]] = src
    return _frozen(_with_arrays(first, arrays))


def _arrays(part: Int8Part) -> dict:
    """The part's distinct arrays by field name (m only where it is not d itself)."""
    names = ["qs", "qh", "d"] + ([] if part.m is part.d else ["m"])
    return {name: getattr(part, name) for name in names}


def _with_arrays(part: Int8Part, arrays: dict) -> Int8Part:
    # _replace is namedtuple's public API (the underscore only keeps it apart from field names)
    return part._replace(**{**arrays, "m": arrays.get("m", arrays["d"])})


def _repack_rows(tensor_type: Q, rows: np.ndarray, in_dim: int, half_scales: bool) -> Int8Part:
    part = _repack_f32(tensor_type, rows, in_dim)
    if not half_scales:
        return part
    scales = {name: a for name, a in _arrays(part).items() if name in ("d", "m")}
    halves = {name: a.astype(np.float16) for name, a in scales.items()}  # float16 in the file: exact
    assert all(np.array_equal(halves[name].astype(np.float32), a) for name, a in scales.items()), tensor_type
    return _with_arrays(part, {**_arrays(part), **{name: h.view(np.uint16) for name, h in halves.items()}})


def _repack_f32(tensor_type: Q, rows: np.ndarray, in_dim: int) -> Int8Part:
    values, d, m, _ = unpack(tensor_type, rows, in_dim)
    n_rows = rows.shape[0]
    form, qh = _FORMS[tensor_type], np.zeros((n_rows, 0), np.uint32)
    if tensor_type in _MIN_PER_D:
        m, m_factor = d, np.float32(_MIN_PER_D[tensor_type])
    else:
        m_factor = np.float32(1.0)
    if form == U8:
        if tensor_type == Q.Q8_0:
            values = values.view(np.uint8) ^ np.uint8(0x80)  # int8 q -> q + 128 as uint8
        return Int8Part(U8, values, qh, d, m, m_factor)
    v = values.reshape(n_rows, -1, 32)
    qs = ((v[..., :16] & 15) | ((v[..., 16:] & 15) << 4)).astype(np.uint8).reshape(n_rows, -1)
    if form == U5:
        bits = ((v >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
        qh = np.bitwise_or.reduce(bits, axis=-1).astype(np.uint32)  # [R, in/32]
    return Int8Part(form, qs, qh, d, m, m_factor)


def unpack(tensor_type: Q, rows: np.ndarray, in_dim: int):
    """(values [R, in] u8 (q8_0: int8), d [R, in/G] f32, m [R, in/32] f32 or None, G): w = d * value + m
    per group of G weights (q6_k: values 0..63, w = d * (value - 32), G = 16)."""
    n_rows = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(n_rows, -1, GGML_QUANT_SIZES[tensor_type][1])
    def f16(a, b):
        return np.ascontiguousarray(blocks[..., a:b]).view(np.float16)[..., 0].astype(np.float32)
    if tensor_type in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):  # m: q4_0 -8 d, q5_0 -16 d
        has_min, five = tensor_type in (Q.Q4_1, Q.Q5_1), tensor_type in (Q.Q5_0, Q.Q5_1)
        d = f16(0, 2)
        m = f16(2, 4) if has_min else d * np.float32(-16.0 if five else -8.0)
        qs_at = 2 + 2 * has_min + 4 * five
        qs = blocks[..., qs_at : qs_at + 16]
        values = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [R, nb, 32]
        if five:
            qh = np.ascontiguousarray(blocks[..., qs_at - 4 : qs_at]).view(np.uint32)  # [R, nb, 1]
            values = values | (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        return values.reshape(n_rows, in_dim), d, m, 32
    if tensor_type == Q.Q8_0:
        return blocks[..., 2:].view(np.int8).reshape(n_rows, in_dim), f16(0, 2), None, 32
    if tensor_type in (Q.Q4_K, Q.Q5_K):
        return _unpack_k45(blocks, f16, tensor_type == Q.Q5_K, n_rows, in_dim)
    return _unpack_q6_k(blocks, f16, n_rows, in_dim)


def _unpack_k45(blocks, f16, five, n_rows, in_dim):
    d, dmin = f16(0, 2)[..., None], f16(2, 4)[..., None]  # [R, nb, 1]
    sc = blocks[..., 4:16].astype(np.int32)  # ggml's get_scale_min_k4 for sub-blocks 0..7
    scale = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blocks[..., 48:176] if five else blocks[..., 16:144]  # [R, nb, 128]: 4 chunks of 32 bytes
    chunks = qs.reshape(n_rows, -1, 4, 32)
    values = np.stack([chunks & 15, chunks >> 4], axis=3)  # [R, nb, 4, 2, 32]: sub-block 2 i + h
    if five:
        qh = blocks[..., 16:48][:, :, None, None, :]  # bit 2 i + h of qh[l]: sub-block 2 i + h, weight l
        shift = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)[None, None, :, :, None]
        values = values | (((qh >> shift) & 1) << 4)
    d_sub = (d * scale.astype(np.float32)).reshape(n_rows, -1)
    m_sub = -(dmin * mins.astype(np.float32)).reshape(n_rows, -1)
    return values.astype(np.uint8).reshape(n_rows, in_dim), d_sub, m_sub, 32


def _unpack_q6_k(blocks, f16, n_rows, in_dim):
    ql = blocks[..., 0:128].reshape(n_rows, -1, 2, 64)  # per 128-weight half: 64 bytes of low nibbles
    qh = blocks[..., 128:192].reshape(n_rows, -1, 2, 1, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]
    high = (qh >> shifts) & 3  # [R, nb, 2, 4, 32]: weights l, l+32, l+64, l+96 of each half
    low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    values = (low | (high << 4)).astype(np.uint8).reshape(n_rows, in_dim)
    scales = blocks[..., 192:208].view(np.int8).astype(np.float32)  # [R, nb, 16]: weights 16 k .. 16 k + 15
    d = (f16(208, 210)[..., None] * scales).reshape(n_rows, -1)
    return values, d, None, 16


def _frozen(part: Int8Part) -> Int8Part:
    arrays = {name: np.ascontiguousarray(a) for name, a in _arrays(part).items()}
    for a in arrays.values():
        a.flags.writeable = False
    return _with_arrays(part, arrays)
