"""Float32 rows decoded from the repacked weight forms (cpu/int8_repack.py), so nothing reads the GGUF rows
once a model's weights are repacked: prefill tiles, 2-8-token products, the embedding lookup.

    U4   w[32 b + j] = d * (qs[16 b + j] & 15) + m,   w[32 b + 16 + j] = d * (qs[16 b + j] >> 4) + m
    U5   U4's, with bit j of qh[b] as bit 4 of weight 32 b + j
    U8   w[i] = d[i / G] * qs[i] + m[i / G]

with d, m float32 or float16 bits (half.as_float) and m times the part's m_factor. The same float32
products gguf's dequantisation computes from the file's blocks (checked in tests/test_cpu_repacked_rows.py
for every type). Parts are the (form, qs, qh, d, m, m_factor) tuples of int8_repack.Int8Part.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends.cpu.half import as_float
from engine.backends.cpu.int8_repack import U5, U8
from engine.backends.cpu.numba_cache_deps import key_on_sources

_F32, _U8, _U32 = np.float32, np.uint8, np.uint32
_FASTMATH = {"reassoc", "nsz"}  # no contract: d * q + m rounded twice, as numpy's dequantisation
_LOW, _SHIFT = _U8(15), _U8(4)
_ROWS_PER_TASK = 16


@njit(cache=True, fastmath=_FASTMATH)
def decode_row(part, r, w):
    """w [in] float32 = row r of a repacked part."""
    form, qs, qh, d, m, m_factor = part
    if form == U8:
        group = w.size // d.shape[1]
        for g in range(d.shape[1]):
            dg, mg = as_float(d[r, g]), as_float(m[r, g]) * m_factor
            for j in range(group):
                w[g * group + j] = dg * _F32(qs[r, g * group + j]) + mg
        return
    for b in range(d.shape[1]):
        db, mb = as_float(d[r, b]), as_float(m[r, b]) * m_factor
        if form == U5:  # bit j of qh[r, b]: bit 4 of weight 32 b + j
            bits = qh[r, b]
            for j in range(16):
                q = qs[r, b * 16 + j]
                w[b * 32 + j] = db * _F32((q & _LOW) | _U8(((bits >> _U32(j)) & _U32(1)) << _U32(4))) + mb
                w[b * 32 + 16 + j] = db * _F32((q >> _SHIFT) | _U8(((bits >> _U32(j + 16)) & _U32(1)) << _U32(4))) + mb
            continue
        for j in range(16):
            q = qs[r, b * 16 + j]
            w[b * 32 + j] = db * _F32(q & _LOW) + mb
            w[b * 32 + 16 + j] = db * _F32(q >> _SHIFT) + mb


@njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def rows_into(part, first, last, x, y, col0, w):
    """y[:, col0 + r] = x @ row r for rows first .. last - 1 (each decoded once into w [in], then dotted with
    every token)."""
    for r in range(first, last):
        decode_row(part, r, w)
        for t in range(x.shape[0]):
            acc = _F32(0.0)
            for i in range(w.size):
                acc += w[i] * x[t, i]
            y[t, col0 + r] = acc


@njit(parallel=True, cache=True)
def matmul_part(part, x, y, col0):
    """y[:, col0 : col0 + rows] = x @ part.T, parallel over 16-row tasks (few-token products)."""
    n = part[1].shape[0]
    for task in prange((n + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        w = np.empty(x.shape[1], np.float32)
        first = task * _ROWS_PER_TASK
        rows_into(part, first, min(n, first + _ROWS_PER_TASK), x, y, col0, w)


@njit(cache=True)
def dequant_part(part, first, out):
    """out[i] = row first + i decoded, for a tile out [n, in] (serial: BLAS takes the cores next)."""
    for i in range(out.shape[0]):
        decode_row(part, first + i, out[i])


@njit(parallel=True, cache=True)
def gather_part(part, ids, out):
    """out[t] = row ids[t] decoded (the embedding lookup)."""
    for t in prange(ids.shape[0]):
        decode_row(part, ids[t], out[t])


key_on_sources(globals(), ["engine.backends.cpu.half", "engine.backends.cpu.int8_repack"])
