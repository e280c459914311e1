"""GGUF rows repacked at load for the int8-activation decode products (engine/backends/cpu/int8_matvec.py).

Every supported type becomes one of two planar forms, the integers in one array and the float scales in
their own (float32, or float16 bits for HALF_SCALE_TYPES when a model's every linear allows it), so the
kernels' inner loops read contiguous bytes and no float16 table:

    U4   qs [R, in/2] u8, d, m [R, in/32] f32        w = d * nibble + m    q4_0 (m = -8 d), q4_1, q4_k
    U8   qs [R, in] u8, d, m [R, in/G] f32           w = d * byte + m      q8_0 (byte = q + 128, m = -128 d),
                                                                            q6_k (G = 16, m = -32 d), q5_0
                                                                            (m = -16 d), q5_1, q5_k (G = 32)

In U4 byte j of a 32-weight block holds weight j in its low nibble and weight j + 16 in its high one
(the q4_0 / q4_1 layout); the k-quants' 6-bit sub-block scales and mins are multiplied out into d and m
(d = d_super * sc, m = -dmin_super * mn, each a float32 product as ggml's dequantisation does it).
The 5-bit types are widened to a byte a weight: extracting the fifth bit from a packed u32 per lane did
not vectorise (2.5-3.1 Gweights/s per thread against 8.5 for U4, measured), bytes do. Unsigned bytes with
the offset moved into m: LLVM's products of zero-extended bytes ran at 8.4 Gweights/s, of sign-extended
int8 at 7.2 (one thread, SmolLM2's 49152 x 576 head).
Memory: q4_1 20 -> 24 bytes per 32 weights, q4_0 18 -> 24, q5_0 22 -> 36, q5_1 / q5_k -> 40, q8_0 34 -> 36,
q4_k 4.5 -> 6 bits a weight, q6_k 6.56 -> 10 bits. `unpack` is checked against gguf.quants' dequantisation in
tests/test_cpu_int8_matvec.py for every type.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from engine.quant_types import HALF_SCALE_TYPES, INT8_TYPES  # the types repacked; those with float16 scales

U4, U8 = 0, 1  # forms (a jitted function dispatches on an int)
REPACK_ROWS = 4096


class Int8Part(NamedTuple):
    """One repacked part; the tuple (form, qs, qh, d, m) is what the kernels take. Arrays read-only."""
    form: int
    qs: np.ndarray  # uint8 [R, in/2] (U4) or [R, in] (U8)
    qh: np.ndarray  # uint32 [R, 0]: reserved (a packed fifth-bit plane), unused by both forms
    d: np.ndarray   # float32 [R, in/G]: G = 32 (U4, U8) or 16 (U8 of q6_k); or float16 bits (uint16)
    m: np.ndarray   # d's shape and type


def empty_part(half_scales: bool = False) -> Int8Part:
    """The absent second part of a one-part linear (0 rows, the same array types)."""
    scale = np.uint16 if half_scales else np.float32
    return _frozen(Int8Part(U4, np.zeros((0, 16), np.uint8), np.zeros((0, 1), np.uint32),
                            np.zeros((0, 1), scale), np.zeros((0, 1), scale)))


def half_scales_fit(tensor_type: Q, rows: np.ndarray) -> bool:
    """Whether repack(..., half_scales=True) of these rows succeeds: the derived mins (-8 d, -16 d, -128 d)
    stay within float16's range (d and the stored mins are float16 already)."""
    if tensor_type not in HALF_SCALE_TYPES:
        return False
    factor = {Q.Q4_0: 8.0, Q.Q5_0: 16.0, Q.Q8_0: 128.0}.get(tensor_type)
    if factor is None or rows.size == 0:
        return True
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, GGML_QUANT_SIZES[tensor_type][1])
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32)
    return bool(np.all(np.abs(d) * np.float32(factor) <= np.float32(65504.0)))


def repack(tensor_type: Q, rows: np.ndarray, in_dim: int, half_scales: bool = False) -> Int8Part:
    """Raw GGUF rows [R, row_bytes] of `tensor_type` -> an Int8Part (new arrays; `rows` is not kept).

    half_scales: d and m as float16 bits (uint16, half.as_float in the kernels), 4 bytes a group fewer;
    only for HALF_SCALE_TYPES, whose scales are float16 in the file (q4_0's -8 d and q8_0's -128 d are exact
    too); ValueError if a value does not survive the round trip (it always does unless -128 d overflows).
    In chunks of REPACK_ROWS rows: the numpy temporaries of a whole tensor at once raised gemma3's peak
    RSS by 800 MiB for its 262144-row head (measured), a chunk's by a few MiB."""
    if half_scales and tensor_type not in HALF_SCALE_TYPES:
        raise ValueError(f"{tensor_type.name} scales are not float16 in the file")
    n_rows = rows.shape[0]
    first = _repack_rows(tensor_type, rows[:REPACK_ROWS], in_dim, half_scales)
    if n_rows <= REPACK_ROWS:
        return _frozen(first)
    out = Int8Part(first.form, *[np.empty((n_rows, a.shape[1]), a.dtype) for a in first[1:]])
    for start in range(0, n_rows, REPACK_ROWS):
        chunk = first if start == 0 else _repack_rows(tensor_type, rows[start : start + REPACK_ROWS], in_dim,
                                                      half_scales)
        for dst, src in zip(out[1:], chunk[1:]):
            dst[start : start + src.shape[0]] = src
    return _frozen(out)


def _repack_rows(tensor_type: Q, rows: np.ndarray, in_dim: int, half_scales: bool) -> Int8Part:
    part = _repack_f32(tensor_type, rows, in_dim)
    if not half_scales:
        return part
    with np.errstate(over="ignore"):  # an overflow becomes inf and fails the round trip below
        halves = [a.astype(np.float16) for a in (part.d, part.m)]
    if not all(np.array_equal(h.astype(np.float32), a) for h, a in zip(halves, (part.d, part.m))):
        raise ValueError(f"{tensor_type.name} scales do not round-trip through float16")
    # _replace is namedtuple's public API (the underscore only keeps it apart from field names)
    return part._replace(d=halves[0].view(np.uint16), m=halves[1].view(np.uint16))


def _repack_f32(tensor_type: Q, rows: np.ndarray, in_dim: int) -> Int8Part:
    values, d, m, group = unpack(tensor_type, rows, in_dim)
    n_rows = rows.shape[0]
    no_qh = np.zeros((n_rows, 0), np.uint32)
    if tensor_type in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        v = values.reshape(n_rows, -1, 32)
        qs = ((v[..., :16] & 15) | ((v[..., 16:] & 15) << 4)).astype(np.uint8).reshape(n_rows, -1)
        return Int8Part(U4, qs, no_qh, d, m)
    if tensor_type == Q.Q8_0:
        values = values.view(np.uint8) ^ np.uint8(0x80)  # int8 q -> q + 128 as uint8
        m = d * np.float32(-128.0)
    elif tensor_type == Q.Q6_K:
        m = d * np.float32(-32.0)
    return Int8Part(U8, values, no_qh, d, m)


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
    arrays = [np.ascontiguousarray(a) for a in part[1:]]
    for a in arrays:
        a.flags.writeable = False
    return Int8Part(part.form, *arrays)
