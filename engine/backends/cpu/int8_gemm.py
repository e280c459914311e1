"""Prefill products on integers: a chunk's activations quantised per 32-value block, multiplied by the
repacked weights (cpu/int8_repack.py) in 32-row tiles with integer dot products (cpu/vnni_tile.py).

    x [T, in] float32 --quantize_act--> xq [T, in] int8 (qmax 127) or int16 (32767), dx, per-group sums sx
    for each tile of 32 weight rows (in parallel, both threads):
        unpack_tile: the rows' integers into vpdpbusd's / vpdpwssd's order (32 * in bytes or int16s: 28-56 KiB
                     for in = 896, 152-304 KiB for 4864, in L2) and their scales and mins transposed
        for tokens in fours: y[t, tile] = tile . xq[t] (exact int32 sums per group, scaled in float32)

The rule is the decode products' (cpu/int8_matvec.py; qmax 127 is ggml's q8 one): dx = max|x_block| / qmax,
xq = round(x / dx), so the only rounding beyond float32 is the activations' (|x - dx xq| <= dx / 2 per
value): a product's error is at most sum over blocks of dx / 2 * sum |w| (tests/test_cpu_int8_gemm.py
checks that bound against gguf's dequantisation, and the integer part against the same quantised x). The
backend's --cpu-weights activations pick qmax, so a decode token computed inside a prefill step is rounded
as it is in a decode step alone. No float32 copy of the weights exists at any time: a tile's unpacked
integers are each task's own buffer.
Throughput (this 2-core AVX-512 VNNI Xeon) is in docs/BENCHMARKS.md (scripts/bench_prefill.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.core import types
from numba.extending import overload

from engine.backends.cpu.gguf_row_kernels import call_kernel
from engine.backends.cpu.half import as_float
from engine.backends.cpu.int8_matvec import block_scale, round_half_away
from engine.backends.cpu.int8_repack import U5, U8
from engine.backends.cpu.numba_cache_deps import key_on_sources
from engine.backends.cpu.vnni_tile import MAX_TOKENS, TILE_ROWS, tile_dot

_F32, _I32 = np.float32, np.int32
_FASTMATH = {"reassoc", "contract", "nsz"}  # no nnan / ninf: a non-finite activation makes its product NaN


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def quantize_into(x, qmax, act):
    """x [T, in] float32 quantised per 32-value block into act = new_act(T, in, dtype): xq = round(x / dx)
    (half away from zero, as ggml's roundf), dx = max|x_block| / qmax (NaN if the block holds a non-finite
    value), sx = dx * sum xq over each group (32 values, or the block's halves for 16-weight groups)."""
    xq, dx32, sx32, dx16, sx16 = act
    for t in prange(x.shape[0]):
        for b in range(x.shape[1] // 32):
            d, inv = block_scale(x, t, b, qmax)  # the decode quantiser's rule (int8_matvec.py)
            low, high = _I32(0), _I32(0)
            for j in range(32):
                q = round_half_away(x[t, b * 32 + j] * inv)
                xq[t, b * 32 + j] = q
                if j < 16:
                    low += q
                else:
                    high += q
            dx32[t, b], dx16[t, 2 * b], dx16[t, 2 * b + 1] = d, d, d
            sx32[t, b] = d * _F32(low + high)
            sx16[t, 2 * b], sx16[t, 2 * b + 1] = d * _F32(low), d * _F32(high)


def quantize_act(x: np.ndarray, qmax: float) -> tuple:
    """(xq [T, in] int8 for qmax 127 / int16 for 32767, dx32, sx32 [T, in/32], dx16, sx16 [T, in/16] float32)."""
    n_tok, n_in = x.shape
    nb = n_in // 32
    act = (np.empty((n_tok, n_in), np.int8 if qmax <= 127 else np.int16),
           np.empty((n_tok, nb), np.float32), np.empty((n_tok, nb), np.float32),
           np.empty((n_tok, 2 * nb), np.float32), np.empty((n_tok, 2 * nb), np.float32))
    call_kernel(quantize_into, x, _F32(qmax), act)
    return act


@njit(cache=True)
def unpack_tile(part, r0, n, wt, dt, mt, rows):
    """Rows r0 .. r0 + n - 1 (n <= 32) of a repacked part into a tile: wt [in * 32] (uint8: 4 weights a
    lane; int16: 2) in vnni_tile's order, dt / mt [groups * 32] float32; lanes n .. 31 get zero weights,
    scales and mins. rows [32, in] (wt's dtype) is scratch: the rows are first expanded one after another
    (contiguous writes LLVM vectorises), then moved a 32-bit lane at a time into the tile's order, a
    [32, in / lane] transpose; writing the tile's order weight by weight cost ~5 ns a weight (1.8 s a pass
    over Qwen2.5-0.5B's weights, paid again by every prefill chunk)."""
    form, qs, qh, d, m, m_factor = part
    lane = 4 // wt.itemsize  # weights a 32-bit lane holds
    n_groups = d.shape[1]
    n_in = qs.shape[1] * (1 if form == U8 else 2)
    five = form == U5
    for i in range(TILE_ROWS):
        if i >= n:
            rows[i, :] = 0
            for g in range(n_groups):
                dt[g * TILE_ROWS + i], mt[g * TILE_ROWS + i] = _F32(0.0), _F32(0.0)
            continue
        r = r0 + i
        if form == U8:
            for k in range(n_in):
                rows[i, k] = qs[r, k]
        else:  # byte j of block b: weight 32 b + j low, 32 b + 16 + j high
            for b in range(n_in // 32):
                for j in range(16):
                    q = qs[r, b * 16 + j]
                    rows[i, b * 32 + j] = q & np.uint8(15)
                    rows[i, b * 32 + 16 + j] = q >> np.uint8(4)
            if five:  # bit j of qh[r, b]: bit 4 of weight 32 b + j (a loop of its own: the one above vectorises)
                for b in range(n_in // 32):
                    bits = qh[r, b]
                    for j in range(32):
                        rows[i, b * 32 + j] |= np.uint8(((bits >> np.uint32(j)) & np.uint32(1)) << np.uint32(4))
        for g in range(n_groups):
            dt[g * TILE_ROWS + i] = as_float(d[r, g])
            mt[g * TILE_ROWS + i] = as_float(m[r, g]) * m_factor
    lanes_in, tile_lanes = rows.view(np.uint32), wt.view(np.uint32)  # [32, in / lane], [in / lane * 32]
    for kk in range(n_in // lane):
        for i in range(TILE_ROWS):
            tile_lanes[kk * TILE_ROWS + i] = lanes_in[i, kk]


def tile_buffer(n, like):
    """An uninitialised weight tile of n elements for activations like `like` (jitted code only)."""
    raise NotImplementedError("called from jitted code only")


@overload(tile_buffer)
def _tile_buffer_typed(n, like):
    if like.dtype == types.int8:
        return lambda n, like: np.empty(n, np.uint8)
    return lambda n, like: np.empty(n, np.int16)


@njit(parallel=True, cache=True)
def gemm_part(part, act, y, col0):
    """y[:, col0 : col0 + rows] = x @ part.T for act = quantize_act(x, qmax), parallel over 32-row tiles."""
    qs, d = part[1], part[3]
    xq, dx32, sx32, dx16, sx16 = act
    n_tok, n_in = xq.shape
    n_rows, n_groups = qs.shape[0], d.shape[1]
    group16 = n_groups * 16 == n_in
    for tile in prange((n_rows + TILE_ROWS - 1) // TILE_ROWS):
        wt = tile_buffer(n_in * TILE_ROWS, xq)
        rows = tile_buffer(n_in * TILE_ROWS, xq).reshape(TILE_ROWS, n_in)
        dt, mt = np.empty(n_groups * TILE_ROWS, np.float32), np.empty(n_groups * TILE_ROWS, np.float32)
        yt = np.empty((n_tok, TILE_ROWS), np.float32)
        r0 = tile * TILE_ROWS
        n = min(TILE_ROWS, n_rows - r0)
        unpack_tile(part, r0, n, wt, dt, mt, rows)
        t = 0
        while t < n_tok:
            count = min(MAX_TOKENS, n_tok - t)
            if group16:
                tile_dot(wt, dt, mt, xq, dx16, sx16, t, count, yt)
            else:
                tile_dot(wt, dt, mt, xq, dx32, sx32, t, count, yt)
            t += count
        for t in range(n_tok):
            for i in range(n):
                y[t, col0 + r0 + i] = yt[t, i]


key_on_sources(globals(), ["engine.backends.cpu.half", "engine.backends.cpu.int8_repack",
                           "engine.backends.cpu.vnni_tile", "engine.backends.cpu.int8_matvec",
                           "engine.backends.cpu.llvm_ir"])
