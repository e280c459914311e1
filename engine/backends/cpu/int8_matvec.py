"""Decode products with integer-quantised activations and integer dot products (ggml's q8 path), in numba.

The activations of each token are quantised once per product, per 32-element block (`quantize_act`):

    dx = max|x_block| / qmax,   xq_j = round(x_j / dx)  (int16 lanes),   sx = dx * sum_j xq_j

with qmax 32767 (int16, the default) or 127 (int8, ggml's q8 rule), and a weight group (cpu/int8_repack.py:
w_j = d q_j + m, integer q_j >= 0) meets them as

    x . w  ~=  sum over groups of  d dx (sum_j q_j xq_j)  +  m sx            (int32 inner sums, exact)

so the only rounding beyond float32 is xq's (|x_j - dx xq_j| <= dx / 2): the error bound of a product is
sum over blocks of dx / 2 * sum_j |w_j| (tests/test_cpu_int8_matvec.py checks both that and the tight
bound against the same quantised x). The row products themselves are LLVM vector IR (cpu/simd_dot.py:
vpmaddwd on AVX2, plain vector IR elsewhere): the numba loops they replaced never got vpmaddwd from LLVM
and ran 2.4-3.0 Gweights/s per thread, against 9.8-12.5 for one token and 22-26 for four now (q4_1 / q8_0,
SmolLM2's shapes, AVX2 EPYC, session 7; docs/BENCHMARKS.md). int16 activations cost what int8 ones would with vpmaddwd and round 256x finer.
A non-finite activation makes its block's scale NaN, so the product is NaN, as on the float path.

fused_step.decode_step inlines these kernels; numba's cache alone is keyed on each function's own
file, so a stale fused step was once loaded after an edit here (garbage logits on gemma3's U8 layers):
engine/backends/cpu/numba_cache_deps.py now keys it on this file's source too.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import register_jitable

from engine.backends.cpu.int8_repack import U4, U5
from engine.backends.cpu.numba_cache_deps import key_on_sources
from engine.backends.cpu.simd_dot import MAX_TOKENS, u4_rows, u5_rows, u8_rows16, u8_rows32

_F32, _I32, _I16 = np.float32, np.int32, np.int16
_FASTMATH = {"reassoc", "contract", "nsz"}  # as gguf_row_kernels: no nnan / ninf
_ROWS_PER_TASK = 16


@register_jitable(inline="always")
def block_scale(x, t, b, qmax):
    """(dx, 1 / dx) of block b (32 values) of token t: dx = max|x_block| / qmax, NaN if the block holds a
    non-finite value; 1 / dx is 0 for a block of zeros. Shared by the decode and prefill quantisers
    (int8_gemm.py), so both round a token the same way; inlined, it takes the caller's fastmath flags."""
    amax, finite = _F32(0.0), _F32(0.0)
    for j in range(32):
        amax = max(amax, abs(x[t, b * 32 + j]))
        finite += x[t, b * 32 + j] * _F32(0.0)  # NaN if any value is NaN or infinite
    d = amax / qmax if finite == _F32(0.0) else _F32(np.nan)
    return d, (_F32(1.0) / d if d > _F32(0.0) else _F32(0.0))


@register_jitable(inline="always")
def round_half_away(v):
    """v (|v| <= qmax) to the nearest int32, halves away from zero, as ggml's roundf."""
    return _I32(v + _F32(0.5)) if v >= _F32(0.0) else -_I32(_F32(0.5) - v)


@njit(cache=True)
def new_act(n_tok, n_in):
    """Uninitialised buffers for quantize_act_into of x [n_tok, n_in]."""
    nb = n_in // 32
    return (np.empty((n_tok, n_in // 2), np.int16), np.empty((n_tok, n_in // 2), np.int16),
            np.empty((n_tok, n_in), np.int16), np.empty((n_tok, nb), np.float32),
            np.empty((n_tok, 2 * nb), np.float32), np.empty((n_tok, nb), np.float32),
            np.empty((n_tok, 2 * nb), np.float32))


@njit(cache=True, fastmath=_FASTMATH)
def quantize_act(x, qmax):
    """x [T, in] float32 quantised to integers in [-qmax, qmax] (float32 127: int8, ggml's q8 rule; 32767:
    int16): (xlo, xhi [T, in/2], x16 [T, in] int16, dx [T, in/32], dx16 [T, in/16], sx [T, in/32],
    sx16 [T, in/16] float32); xlo / xhi are each block's first / second 16 values (the U4 nibble order)."""
    act = new_act(x.shape[0], x.shape[1])
    quantize_act_into(x, qmax, act)
    return act


@njit(cache=True, fastmath=_FASTMATH)
def quantize_act_into(x, qmax, act):
    """quantize_act writing into act = new_act(T, in) (the first T rows of larger buffers also do)."""
    for t in range(x.shape[0]):
        quantize_blocks(x, qmax, act, t, 0, x.shape[1] // 32)


@njit(cache=True, fastmath=_FASTMATH)
def quantize_blocks(x, qmax, act, t, first, last):
    """quantize_act_into for blocks first .. last - 1 of token t alone (the fused step splits a product's
    activations into units of blocks)."""
    xlo, xhi, x16, dx, dx16, sx, sx16 = act
    for b in range(first, last):
        d, inv = block_scale(x, t, b, qmax)
        low_sum, high_sum = _I32(0), _I32(0)  # the two halves' sums
        for j in range(32):
            q = _I16(round_half_away(x[t, b * 32 + j] * inv))
            x16[t, b * 32 + j] = q
            if j < 16:
                low_sum += _I32(q)
            else:
                high_sum += _I32(q)
        for j in range(16):
            xlo[t, b * 16 + j] = x16[t, b * 32 + j]
            xhi[t, b * 16 + j] = x16[t, b * 32 + 16 + j]
        dx[t, b], dx16[t, 2 * b], dx16[t, 2 * b + 1] = d, d, d
        sx[t, b] = d * _F32(low_sum + high_sum)
        sx16[t, 2 * b], sx16[t, 2 * b + 1] = d * _F32(low_sum), d * _F32(high_sum)


@njit(cache=True)
def _part_rows(part, first, last, act, y, col0):
    """y[t, col0 + r] = part row r . token t for rows first .. last - 1 and every token, up to MAX_TOKENS
    tokens a call (simd_dot: they share the row's unpacking); a token's result does not depend on the
    tokens it is computed with, so a batch's row t is bit-identical to token t alone."""
    form, qs, qh, d, m, mf = part
    xlo, xhi, x16, dx, dx16, sx, sx16 = act
    n_tok = x16.shape[0]
    for r in range(first, last):
        t = 0
        while t < n_tok:
            n = min(MAX_TOKENS, n_tok - t)
            if form == U4:
                u4_rows(qs, qh, d, m, mf, xlo, xhi, dx, sx, r, t, n, y, col0 + r)
            elif form == U5:
                u5_rows(qs, qh, d, m, mf, xlo, xhi, dx, sx, r, t, n, y, col0 + r)
            elif x16.shape[1] // d.shape[1] == 32:
                u8_rows32(qs, qh, d, m, mf, x16, dx, sx, r, t, n, y, col0 + r)
            else:
                u8_rows16(qs, qh, d, m, mf, x16, dx16, sx16, r, t, n, y, col0 + r)
            t += n


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def matvec2_i8(part0, part1, act, y):
    """y[:, :] = x @ [part0; part1].T for act = quantize_act(x); parts are (form, qs, qh, d, m, m_factor) tuples
    (int8_repack.Int8Part), part1 may have 0 rows. One parallel region over both parts' rows."""
    n0, n1 = part0[1].shape[0], part1[1].shape[0]
    tasks0 = (n0 + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    tasks = tasks0 + (n1 + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    for task in prange(tasks):
        if task < tasks0:
            first = task * _ROWS_PER_TASK
            _part_rows(part0, first, min(n0, first + _ROWS_PER_TASK), act, y, 0)
        else:
            first = (task - tasks0) * _ROWS_PER_TASK
            _part_rows(part1, first, min(n1, first + _ROWS_PER_TASK), act, y, n0)


@njit(cache=True, fastmath=_FASTMATH)
def project_i8(part0, part1, x, qmax):
    """x @ [part0; part1].T as a new [T, out] float32 array (x [T, in] float32 quantised here to qmax).
    The whole product the kernel tests check; the decode step calls _part_rows on its own work units."""
    y = np.empty((x.shape[0], part0[1].shape[0] + part1[1].shape[0]), np.float32)
    matvec2_i8(part0, part1, quantize_act(x, qmax), y)
    return y


# numba caches each function against this file only; the jitted code and constants it calls in from
# these modules are compiled into its entries, so their sources key the cache too.
key_on_sources(globals(), ["engine.backends.cpu.int8_repack", "engine.backends.cpu.simd_dot",
                           "engine.backends.cpu.llvm_ir"])
