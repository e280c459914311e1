"""Few-token products straight on raw GGUF rows, for the fused decode step (engine/backends/cpu/fused_decoder.py).

The block-32 types (q4_0, q4_1, q5_0, q8_0) are dotted block by block without writing a decoded row:

    w_j = d * q_j + m        =>    x . w  =  sum over blocks of  d * (q . x_block) + m * sum(x_block)

with m = -8 d (q4_0), -16 d (q5_0), the stored min (q4_1) or 0 (q8_0), and sum(x_block) computed once per
token (`block_sums`). The integer work stays in uint8 / int32: numba types a Python int literal as int64,
and `q & 15` on an int64 made LLVM widen every lane to 64 bits (vpmovzxbq + vcvtqq2ps, half the SIMD width;
measured 4.6 -> 6 Gweights/s per thread on a SmolLM2 gate_up row set). Other types decode one row into a
per-task float32 buffer (gguf_dequant.decode_row, the unfused kernels' decoder) and dot that; so does
every type when there are several tokens, which then share the decoded row.

numba's disk cache is keyed on this file and on the decoders' (cpu/gguf_dequant.py, cpu/numba_cache_deps.py).
Decoders: f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k mxfp4.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends.cpu.gguf_dequant import Q4_0, Q4_1, Q5_0, Q8_0, decode_row
from engine.backends.cpu.numba_cache_deps import key_on_sources

_F32, _I32, _U8, _U32 = np.float32, np.int32, np.uint8, np.uint32
_FASTMATH = {"reassoc", "contract", "nsz"}  # as gguf_row_kernels: no nnan / ninf
_ROWS_PER_TASK = 16
_LOW, _SHIFT = _U8(15), _U8(4)


@njit(cache=True, fastmath=_FASTMATH)
def block_sums(x, xs):
    """xs[t, b] = sum of x[t, 32 b : 32 b + 32]; x [T, in] float32, xs [T, in / 32]."""
    for t in range(x.shape[0]):
        block_sums_of(x, xs, t, 0, xs.shape[1])


@njit(cache=True, fastmath=_FASTMATH)
def block_sums_of(x, xs, t, first, last):
    """block_sums for blocks first .. last - 1 of token t alone."""
    for b in range(first, last):
        s = _F32(0.0)
        for j in range(32):
            s += x[t, b * 32 + j]
        xs[t, b] = s


@njit(inline="always", cache=True)
def _half(row, offset, table):
    return table[_I32(row[offset]) | (_I32(row[offset + 1]) << _I32(8))]


@njit(cache=True, fastmath=_FASTMATH)
def _dot_block32(kind, row, x, xs, t, table, lanes, acc):
    """x[t] . row for a block-32 kind (see the module docstring); lanes is 16, passed at run time.

    acc [lanes] float32 scratch: per-lane partial sums over all blocks, reduced once per row (a horizontal
    sum per 32-weight block cost 25% more, measured)."""
    acc[:] = 0.0
    offsets = _F32(0.0)  # sum over blocks of m * sum(x_block)
    for b in range(xs.shape[1]):
        base = b * 32
        if kind == Q4_1:
            o = b * 20
            d = _half(row, o, table)
            offsets += _half(row, o + 2, table) * xs[t, b]
            for j in range(lanes):
                q = row[o + 4 + j]
                acc[j] += d * (_F32(q & _LOW) * x[t, base + j] + _F32(q >> _SHIFT) * x[t, base + j + 16])
        elif kind == Q4_0:
            o = b * 18
            d = _half(row, o, table)
            offsets -= _F32(8.0) * d * xs[t, b]
            for j in range(lanes):
                q = row[o + 2 + j]
                acc[j] += d * (_F32(q & _LOW) * x[t, base + j] + _F32(q >> _SHIFT) * x[t, base + j + 16])
        elif kind == Q8_0:
            o = b * 34
            d = _half(row, o, table)
            for j in range(lanes):
                acc[j] += d * (_F32(np.int8(row[o + 2 + j])) * x[t, base + j]
                               + _F32(np.int8(row[o + 18 + j])) * x[t, base + j + 16])
        else:  # Q5_0: d | qh[4] | qs[16]; bit j of qh is weight j's fifth bit, bit j + 16 weight j + 16's
            o = b * 22
            d = _half(row, o, table)
            offsets -= _F32(16.0) * d * xs[t, b]
            qh = (_U32(row[o + 2]) | (_U32(row[o + 3]) << _U32(8)) | (_U32(row[o + 4]) << _U32(16))
                  | (_U32(row[o + 5]) << _U32(24)))
            for j in range(lanes):
                q = row[o + 6 + j]
                lo = _U32(q & _LOW) | (((qh >> _U32(j)) & _U32(1)) << _U32(4))
                hi = _U32(q >> _SHIFT) | (((qh >> _U32(j + 16)) & _U32(1)) << _U32(4))
                acc[j] += d * (_F32(lo) * x[t, base + j] + _F32(hi) * x[t, base + j + 16])
    total = offsets
    for j in range(lanes):
        total += acc[j]
    return total


@njit(cache=True, fastmath=_FASTMATH)
def _rows_into(kind, rows, first, last, x, xs, y, col0, w, table, lanes):
    """y[:, col0 + r] = x @ row r for rows first .. last - 1 of one part; w: a float32 [in] buffer (its first
    `lanes` floats are the direct dot's accumulators)."""
    # Several tokens share one decoded row (decoding once beats extracting the integers once per token:
    # 2x at T = 4, measured); one token is dotted block by block.
    direct = x.shape[0] == 1 and (kind == Q4_0 or kind == Q4_1 or kind == Q5_0 or kind == Q8_0)
    for r in range(first, last):
        if direct:
            for t in range(x.shape[0]):
                y[t, col0 + r] = _dot_block32(kind, rows[r], x, xs, t, table, lanes, w[:lanes])
        else:
            decode_row(kind, rows[r], w, table, w.view(np.uint32), lanes)
            for t in range(x.shape[0]):
                acc = _F32(0.0)
                for i in range(w.size):
                    acc += w[i] * x[t, i]
                y[t, col0 + r] = acc


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def matvec2(kind0, rows0, kind1, rows1, x, xs, y, table, lanes):
    """y[:, :] = x @ [part0; part1].T, one parallel region over both parts' rows (rows1 may have 0 rows).
    The whole product the kernel tests check; the decode step calls _rows_into on its own work units.

    x [T, in] float32, xs = block_sums(x), y [T, out0 + out1] float32."""
    n0, n1 = rows0.shape[0], rows1.shape[0]
    tasks0 = (n0 + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    tasks = tasks0 + (n1 + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    for task in prange(tasks):
        w = np.empty(x.shape[1], np.float32)
        if task < tasks0:
            first = task * _ROWS_PER_TASK
            _rows_into(kind0, rows0, first, min(n0, first + _ROWS_PER_TASK), x, xs, y, 0, w, table, lanes)
        else:
            first = (task - tasks0) * _ROWS_PER_TASK
            _rows_into(kind1, rows1, first, min(n1, first + _ROWS_PER_TASK), x, xs, y, n0, w, table, lanes)


# numba caches each function against this file only; the jitted code and constants it calls in from
# these modules are compiled into its entries, so their sources key the cache too.
key_on_sources(globals(), ["engine.backends.cpu.gguf_dequant"])
