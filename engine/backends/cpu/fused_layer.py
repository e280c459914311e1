"""The pieces of the fused decode step (cpu/fused_step.py), in numba: norms, RoPE, one head's attention,
a span of the gated activation, and the products as work units over either weight form.

An optional weight (bias, QK-norm, post norms) is passed as a 0-length array when the model has none.
Products: a linear is raw GGUF rows (float activations, fused_matvec) or two parts repacked for
integer activations (int8_matvec); `product_rows` computes one unit (a slice of output rows) of either,
the overload picked by numba from the tuple's type when it compiles the step.
numba's disk cache is keyed on this file and on the kernel files whose code it inlines (the decoders, the
float and integer matvecs: engine/backends/cpu/numba_cache_deps.py), so an edit to any of them recompiles it.
The overloads are not cached themselves: numba caches an overload's implementation under this file alone,
out of key_on_sources' reach, and a cached `product_rows` kept the step on the integer kernels of an
earlier int8_matvec (found in session 7 by disassembling the running step); their callers' entries,
which are keyed, hold them compiled in.
Decoders: f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k mxfp4.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba.core import types
from numba.extending import overload

from engine.backends.cpu.fused_matvec import _rows_into, block_sums_of
from engine.backends.cpu.half import as_float
from engine.backends.cpu.int8_matvec import _part_rows, quantize_blocks
from engine.backends.cpu.int8_matvec import new_act as new_int_act
from engine.backends.cpu.numba_cache_deps import key_on_sources
from engine.backends.cpu.repacked_rows import rows_into as decoded_rows_into

_F32 = np.float32
_FASTMATH = {"reassoc", "contract", "nsz"}
_GELU_C = _F32(math.sqrt(2.0 / math.pi))
SILU, GELU_TANH = 0, 1  # activation ids


@njit(cache=True, fastmath=_FASTMATH)
def rms_norm_into(x, w, out, eps):
    """out = x / sqrt(mean(x^2) + eps) * w over one vector (x and out may be the same array)."""
    ss = _F32(0.0)
    for i in range(x.size):
        ss += x[i] * x[i]
    inv = _F32(1.0) / np.sqrt(ss / _F32(x.size) + eps)
    for i in range(x.size):
        out[i] = x[i] * inv * w[i]


@njit(cache=True, fastmath=_FASTMATH)
def rope(v, cos, sin, pos, rope_dims):
    """Rotate v[:rope_dims] in place by position pos, half-split (NeoX) pairs (i, i + rope_dims / 2)."""
    half = rope_dims // 2
    for i in range(half):
        c, s = cos[pos, i], sin[pos, i]
        a, b = v[i], v[i + half]
        v[i] = a * c - b * s
        v[i + half] = b * c + a * s


@njit(cache=True, fastmath=_FASTMATH)
def heads_per_unit(n_tok, n_heads, n_kv_heads, n_workers):
    """Query heads one attention unit computes: the most of a K/V head's group (a divisor of it) that still
    leaves every worker a unit (units a multiple of the workers, or at least 4 a worker); 1 otherwise."""
    group = n_heads // n_kv_heads
    for h in range(group, 0, -1):
        units = n_tok * n_heads // h
        if group % h == 0 and (units % n_workers == 0 or units >= 4 * n_workers):
            return h
    return 1


@njit(cache=True, fastmath=_FASTMATH)
def attend_heads(q, h0, nh, k_pool, v_pool, kv_head, pos, table_row, block_size, window, out):
    """out[h * hd : (h + 1) * hd] = softmax(q_h . keys) values for the query heads h0 .. h0 + nh - 1 of one
    token's row q [H * hd] (pre-scaled), all reading K/V head kv_head, over key positions first .. pos of one
    sequence; the pools are float32 or float16 bits (half.as_float).

    Each key and value row is widened once for the group of heads that reads it (one head at a time widened
    and walked the paged keys once a head: 1.3x slower at 2K keys, Qwen2.5-Coder-0.5B's 7 heads a K/V head;
    each head's sums run in the same order, so the result is bit-identical). Keys are walked block by block
    (a slot per key without a division: two integer divisions a key were most of the cost, SmolLM2 at 2048
    keys), the exponentials taken in a loop of their own."""
    hd = k_pool.shape[2]
    first = max(0, pos - window + 1) if window > 0 else 0
    n = pos + 1 - first
    scores = np.empty((nh, n), np.float32)
    qs = np.empty((nh, hd), np.float32)
    for g in range(nh):
        for j in range(hd):
            qs[g, j] = q[(h0 + g) * hd + j]
    keys, values = k_pool[kv_head], v_pool[kv_head]
    row = np.empty(hd, np.float32)
    i = 0
    for b in range(first // block_size, pos // block_size + 1):
        base = table_row[b] * block_size
        for slot in range(base + max(first - b * block_size, 0), base + min(pos - b * block_size + 1, block_size)):
            for j in range(hd):
                row[j] = as_float(keys[slot, j])
            for g in range(nh):
                s = _F32(0.0)
                for j in range(hd):
                    s += qs[g, j] * row[j]
                scores[g, i] = s
            i += 1
    totals = np.empty(nh, np.float32)
    for g in range(nh):
        best = scores[g].max()
        total = _F32(0.0)
        for i in range(n):
            e = np.exp(scores[g, i] - best)
            scores[g, i] = e
            total += e
        totals[g] = total
    acc = np.zeros((nh, hd), np.float32)
    i = 0
    for b in range(first // block_size, pos // block_size + 1):
        base = table_row[b] * block_size
        for slot in range(base + max(first - b * block_size, 0), base + min(pos - b * block_size + 1, block_size)):
            for j in range(hd):
                row[j] = as_float(values[slot, j])
            for g in range(nh):
                e = scores[g, i]
                for j in range(hd):
                    acc[g, j] += e * row[j]
            i += 1
    for g in range(nh):
        for j in range(hd):
            out[(h0 + g) * hd + j] = acc[g, j] / totals[g]


@njit(cache=True, fastmath=_FASTMATH)
def activate_span(gate_up, act, out, t, first, last):
    """out[t, first:last] = act(gate) * up there, for gate_up [T, 2F] = (gate | up) and out [T, F]."""
    f = out.shape[1]
    for i in range(first, last):
        g, u = gate_up[t, i], gate_up[t, f + i]
        if act == SILU:
            out[t, i] = g / (_F32(1.0) + np.exp(-g)) * u
        else:
            inner = _GELU_C * (g + _F32(0.044715) * g * g * g)
            out[t, i] = _F32(0.5) * g * (_F32(1.0) + np.tanh(inner)) * u


def linear_rows(linear):
    """(rows of part 0, rows of part 1) of a linear in either form (see fill_act)."""
    raise NotImplementedError("called from jitted code only")


def new_act(linear, n_tok, n_in):
    """The activation buffers product_rows reads for x [n_tok, n_in] against `linear`: per-block sums for
    raw rows (float activations), int8_matvec's quantised integers for repacked parts."""
    raise NotImplementedError("called from jitted code only")


def fill_act(linear, x, qmax, act):
    """Fill act = new_act(linear, *x.shape) from x (float block sums, or integers of at most qmax)."""
    raise NotImplementedError("called from jitted code only")


def fill_act_span(linear, x, qmax, act, t, first, last):
    """fill_act for elements first .. last - 1 of token t alone (first a multiple of 32; the blocks that
    start in the span, so spans ending at a multiple of 32, or at the row's end, tile a row exactly)."""
    raise NotImplementedError("called from jitted code only")


def product_rows(linear, unit, unit_rows, x, act, y, table, lanes):
    """y[:, rows] = x @ W[rows].T for the rows of work unit `unit` (unit_rows rows of part 0, then part 1).

    A linear is raw rows (kind0, rows0, kind1, rows1) (float activations, fused_matvec), two
    int8_repack parts (integer activations, int8_matvec), or those parts and a 0 (float activations
    on rows decoded from them, repacked_rows, once they replaced the raw rows); numba picks the implementation from the
    tuple's type when it compiles the step. Scratch is allocated per unit, of the exact size: a slice of a
    larger buffer is typed as strided by numba, and the loops over it did not vectorise."""
    raise NotImplementedError("called from jitted code only")


def _is_raw(linear) -> bool:
    return isinstance(linear, types.BaseTuple) and len(linear) == 4


def _is_decoded(linear) -> bool:
    """Repacked parts with float activations: (part0, part1, 0)."""
    return isinstance(linear, types.BaseTuple) and len(linear) == 3


@overload(linear_rows)
def _linear_rows_typed(linear):
    if _is_raw(linear):
        return lambda linear: (linear[1].shape[0], linear[3].shape[0])
    return lambda linear: (linear[0][1].shape[0], linear[1][1].shape[0])


@overload(new_act)
def _new_act_typed(linear, n_tok, n_in):
    if _is_decoded(linear):  # rows are decoded and dotted with x itself
        return lambda linear, n_tok, n_in: np.empty((n_tok, 0), np.float32)
    if _is_raw(linear):
        return lambda linear, n_tok, n_in: np.empty((n_tok, n_in // 32), np.float32)
    return lambda linear, n_tok, n_in: new_int_act(n_tok, n_in)


@overload(fill_act_span)
def _fill_act_span_typed(linear, x, qmax, act, t, first, last):
    if _is_decoded(linear):
        return lambda linear, x, qmax, act, t, first, last: None
    if _is_raw(linear):
        return lambda linear, x, qmax, act, t, first, last: block_sums_of(x, act, t, first // 32,
                                                                            min(act.shape[1], (last + 31) // 32))
    return lambda linear, x, qmax, act, t, first, last: quantize_blocks(x, qmax, act, t, first // 32,
                                                                         min(x.shape[1] // 32, (last + 31) // 32))


@overload(fill_act)
def _fill_act_typed(linear, x, qmax, act):
    def whole(linear, x, qmax, act):  # every token's whole row: one span each
        for t in range(x.shape[0]):
            fill_act_span(linear, x, qmax, act, t, 0, x.shape[1])
    return whole


@overload(product_rows)
def _product_rows_typed(linear, unit, unit_rows, x, act, y, table, lanes):
    if _is_decoded(linear):
        def decoded(linear, unit, unit_rows, x, act, y, table, lanes):
            n0, n1 = linear[0][1].shape[0], linear[1][1].shape[0]
            units0 = (n0 + unit_rows - 1) // unit_rows
            w = np.empty(x.shape[1], np.float32)
            if unit < units0:
                first = unit * unit_rows
                decoded_rows_into(linear[0], first, min(n0, first + unit_rows), x, y, 0, w)
            else:
                first = (unit - units0) * unit_rows
                decoded_rows_into(linear[1], first, min(n1, first + unit_rows), x, y, n0, w)
        return decoded
    if _is_raw(linear):
        def raw(linear, unit, unit_rows, x, act, y, table, lanes):
            n0, n1 = linear[1].shape[0], linear[3].shape[0]
            units0 = (n0 + unit_rows - 1) // unit_rows
            w = np.empty(x.shape[1], np.float32)
            if unit < units0:
                first = unit * unit_rows
                _rows_into(linear[0], linear[1], first, min(n0, first + unit_rows), x, act, y, 0, w, table, lanes)
            else:
                first = (unit - units0) * unit_rows
                _rows_into(linear[2], linear[3], first, min(n1, first + unit_rows), x, act, y, n0, w, table,
                           lanes)
        return raw

    def repacked(linear, unit, unit_rows, x, act, y, table, lanes):
        n0, n1 = linear[0][1].shape[0], linear[1][1].shape[0]
        units0 = (n0 + unit_rows - 1) // unit_rows
        if unit < units0:
            first = unit * unit_rows
            _part_rows(linear[0], first, min(n0, first + unit_rows), act, y, 0)
        else:
            first = (unit - units0) * unit_rows
            _part_rows(linear[1], first, min(n1, first + unit_rows), act, y, n0)
    return repacked


@njit(cache=True, fastmath=_FASTMATH)
def add_normed(x, delta, post_norm, eps):
    """x += post_norm ? rmsnorm(delta, post_norm) : delta, row by row (delta is overwritten)."""
    for t in range(x.shape[0]):
        if post_norm.size:
            rms_norm_into(delta[t], post_norm, delta[t], eps)
        for i in range(x.shape[1]):
            x[t, i] += delta[t, i]


# numba caches each function against this file only; the jitted code and constants it calls in from
# these modules are compiled into its entries, so their sources key the cache too.
key_on_sources(globals(), ["engine.backends.cpu.fused_matvec", "engine.backends.cpu.half",
                           "engine.backends.cpu.repacked_rows", "engine.backends.cpu.int8_matvec",
                           "engine.backends.cpu.int8_repack", "engine.backends.cpu.gguf_dequant",
                           "engine.backends.cpu.simd_dot", "engine.backends.cpu.llvm_ir"])
