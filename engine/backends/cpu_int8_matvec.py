"""Decode products with integer-quantised activations and integer dot products (ggml's q8 path), in numba.

The activations of each token are quantised once per product, per 32-element block (`quantize_act`):

    dx = max|x_block| / qmax,   xq_j = round(x_j / dx)  (int16 lanes),   sx = dx * sum_j xq_j

with qmax 32767 (int16, the default) or 127 (int8, ggml's q8 rule), and a weight group (cpu_int8_repack.py:
w_j = d q_j + m, integer q_j >= 0) meets them as

    x . w  ~=  sum over groups of  d dx (sum_j q_j xq_j)  +  m sx            (int32 inner sums, exact)

so the only rounding beyond float32 is xq's (|x_j - dx xq_j| <= dx / 2): the error bound of a product is
sum over blocks of dx / 2 * sum_j |w_j| (tests/test_cpu_int8_matvec.py checks both that and the tight
bound against the same quantised x). The inner loops are written as zero-extended weights times int16
activations summed into int32, which LLVM turns into vpmaddwd (vpdpwssd with VNNI) on x86 and into the
matching instructions elsewhere; int16 * int16 is typed int64 by numba, so every product is cast back to
int32 before it is summed (else the lanes widen to 64 bits). int16 activations cost what int8 ones do here
(the products are int16 either way; nothing emits vpdpbusd) and round 256x finer. The 16-lane trip count is
passed at run time (`lanes`), as in cpu_quant_decode.py: a constant one made LLVM vectorise the block loop
with gathers (6x slower, measured). Measured one thread, 3072 x 576 q4_1 rows (SmolLM2's gate_up): 8.9
Gweights/s vs 4.5 for the float activation kernel (cpu_fused_matvec.py, `--cpu-weights quantized-f32act`).
A non-finite activation makes its block's scale NaN, so the product is NaN, as on the float path.

cpu_fused_step.decode_step inlines these kernels; numba's cache alone is keyed on each function's own
file, so a stale fused step was once loaded after an edit here (garbage logits on gemma3's U8 layers):
engine/backends/numba_cache_deps.py now keys it on this file's source too.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends.cpu_half import as_float
from engine.backends.cpu_int8_repack import U8
from engine.backends.numba_cache_deps import key_on_sources

_F32, _I32, _I16, _U8, _U32 = np.float32, np.int32, np.int16, np.uint8, np.uint32
_FASTMATH = {"reassoc", "contract", "nsz"}  # as cpu_quant_kernels: no nnan / ninf
_ROWS_PER_TASK = 16
_LOW, _SHIFT = _U8(15), _U8(4)


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
    xlo, xhi, x16, dx, dx16, sx, sx16 = act
    n_tok, n_in = x.shape
    nb = n_in // 32
    for t in range(n_tok):
        for b in range(nb):
            amax, finite = _F32(0.0), _F32(0.0)
            for j in range(32):
                amax = max(amax, abs(x[t, b * 32 + j]))
                finite += x[t, b * 32 + j] * _F32(0.0)  # NaN if any value is NaN or infinite
            d = amax / qmax if finite == _F32(0.0) else _F32(np.nan)
            inv = _F32(1.0) / d if d > _F32(0.0) else _F32(0.0)
            sums = np.zeros(2, np.int32)  # the two halves' sums
            for j in range(32):
                v = x[t, b * 32 + j] * inv  # |v| <= qmax; rounded half away from zero, as ggml's roundf
                q = _I16(_I32(v + _F32(0.5)) if v >= _F32(0.0) else -_I32(_F32(0.5) - v))
                x16[t, b * 32 + j] = q
                sums[j // 16] += _I32(q)
            for j in range(16):
                xlo[t, b * 16 + j] = x16[t, b * 32 + j]
                xhi[t, b * 16 + j] = x16[t, b * 32 + 16 + j]
            dx[t, b], dx16[t, 2 * b], dx16[t, 2 * b + 1] = d, d, d
            sx[t, b] = d * _F32(sums[0] + sums[1])
            sx16[t, 2 * b], sx16[t, 2 * b + 1] = d * _F32(sums[0]), d * _F32(sums[1])


@njit(cache=True, fastmath=_FASTMATH)
def _dot_u4_lanes(qs, d, m, r, xlo, xhi, dx, sx, t, acc, lanes):
    """Row r of U4 . token t, the block products kept in float lanes: each lane's int16 pair of products
    is scaled by its block's d dx and summed into acc[lane], one horizontal sum for the row (ggml's way).
    A horizontal integer sum per block, then the scale, ran 5.4 Gweights/s against 8.0 (one thread,
    SmolLM2's gate_up shape); the same change to the byte form gained nothing (7.9 vs 8.0)."""
    acc[:] = 0.0
    offsets = _F32(0.0)
    for b in range(d.shape[1]):
        offsets += as_float(m[r, b]) * sx[t, b]
    for b in range(d.shape[1]):
        s = as_float(d[r, b]) * dx[t, b]
        for j in range(lanes):
            q = qs[r, b * 16 + j]
            acc[j] += _F32(_I32(_I16(q & _LOW) * xlo[t, b * 16 + j] + _I16(q >> _SHIFT) * xhi[t, b * 16 + j])) * s
    for j in range(lanes):
        offsets += acc[j]
    return offsets


@njit(cache=True, fastmath=_FASTMATH)
def _rows_u4(qs, d, m, first, last, xlo, xhi, dx, sx, y, col0, lanes):
    """Every token dotted straight from the bytes (_dot_u4_lanes), so a batch's row t is bit-identical to
    token t alone. Unpacking a row's nibbles once for several tokens saved little next to the products."""
    acc = np.empty(lanes, np.float32)
    for r in range(first, last):
        for t in range(xlo.shape[0]):
            y[t, col0 + r] = _dot_u4_lanes(qs, d, m, r, xlo, xhi, dx, sx, t, acc, lanes)


@njit(cache=True, fastmath=_FASTMATH)
def _scale_u8(d, m, r, dxg, sxg, t, isums):
    acc = _F32(0.0)
    for g in range(d.shape[1]):
        acc += _F32(isums[g]) * (as_float(d[r, g]) * dxg[t, g]) + as_float(m[r, g]) * sxg[t, g]
    return acc


@njit(cache=True, fastmath=_FASTMATH)
def _rows_u8_32(qs, d, m, first, last, x16, dx, sx, y, col0, isums, lanes):
    """Groups of 32 byte weights, one scale and min each; every token dotted straight from the bytes.
    The group's two halves in one loop of `lanes` = 16, as U4's nibbles (one loop of 32 trips ran 25%
    slower); the offset of the second half must be a constant (a run-time one: 13x slower, measured)."""
    for r in range(first, last):
        for t in range(x16.shape[0]):
            for g in range(d.shape[1]):
                isum = _I32(0)
                for j in range(lanes):
                    i = g * 32 + j
                    isum += _I32(_I16(qs[r, i]) * x16[t, i] + _I16(qs[r, i + 16]) * x16[t, i + 16])
                isums[g] = isum
            y[t, col0 + r] = _scale_u8(d, m, r, dx, sx, t, isums)


@njit(cache=True, fastmath=_FASTMATH)
def _rows_u8_16(qs, d, m, first, last, x16, dx16, sx16, y, col0, isums, lanes):
    """_rows_u8_32 for groups of 16 (q6_k): halves of 8, `lanes` = 8."""
    for r in range(first, last):
        for t in range(x16.shape[0]):
            for g in range(d.shape[1]):
                isum = _I32(0)
                for j in range(lanes):
                    i = g * 16 + j
                    isum += _I32(_I16(qs[r, i]) * x16[t, i] + _I16(qs[r, i + 8]) * x16[t, i + 8])
                isums[g] = isum
            y[t, col0 + r] = _scale_u8(d, m, r, dx16, sx16, t, isums)


@njit(cache=True, fastmath=_FASTMATH)
def _part_rows(part, first, last, act, y, col0, isums, lanes):
    form, qs, qh, d, m = part
    xlo, xhi, x16, dx, dx16, sx, sx16 = act
    if form == U8:
        if x16.shape[1] // d.shape[1] == 32:
            _rows_u8_32(qs, d, m, first, last, x16, dx, sx, y, col0, isums, lanes)
        else:
            _rows_u8_16(qs, d, m, first, last, x16, dx16, sx16, y, col0, isums, lanes // 2)
    else:
        _rows_u4(qs, d, m, first, last, xlo, xhi, dx, sx, y, col0, lanes)


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def matvec2_i8(part0, part1, act, y, lanes):
    """y[:, :] = x @ [part0; part1].T for act = quantize_act(x); parts are (form, qs, qh, d, m) tuples
    (cpu_int8_repack.Int8Part), part1 may have 0 rows. One parallel region over both parts' rows."""
    n0, n1 = part0[1].shape[0], part1[1].shape[0]
    tasks0 = (n0 + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    tasks = tasks0 + (n1 + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    for task in prange(tasks):
        isums = np.empty(act[2].shape[1] // 16, np.int32)
        if task < tasks0:
            first = task * _ROWS_PER_TASK
            _part_rows(part0, first, min(n0, first + _ROWS_PER_TASK), act, y, 0, isums, lanes)
        else:
            first = (task - tasks0) * _ROWS_PER_TASK
            _part_rows(part1, first, min(n1, first + _ROWS_PER_TASK), act, y, n0, isums, lanes)


@njit(cache=True, fastmath=_FASTMATH)
def project_i8(part0, part1, x, qmax, lanes):
    """x @ [part0; part1].T as a new [T, out] float32 array (x [T, in] float32 quantised here to qmax).
    The whole product the kernel tests check; the decode step calls _part_rows on its own work units."""
    y = np.empty((x.shape[0], part0[1].shape[0] + part1[1].shape[0]), np.float32)
    matvec2_i8(part0, part1, quantize_act(x, qmax), y, lanes)
    return y


# numba caches each function against this file only; the jitted code and constants it calls in from
# these modules are compiled into its entries, so their sources key the cache too.
key_on_sources(globals(), ["engine.backends.cpu_int8_repack", "engine.backends.cpu_half"])
