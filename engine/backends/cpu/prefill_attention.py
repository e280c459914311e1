"""Attention of a prefill chunk over the paged K/V in query blocks and key tiles, with an online softmax
(flash attention's recurrence) whose elementwise part runs on every kernel thread.

    qh [KVH, n * group, hd]   the chunk's queries, token-major: row t * group + g is token t's head g of the
                              `group` heads that read one K/V head
    for each block of QUERY_ROWS rows (tokens t0 .. t1 - 1):      m, l, acc: the block's running state (in L2)
        for each tile of up to key_tile(rows) keys the block can see (none after its last token, none before
        its first token's window: causal and sliding-window tiles are skipped, not masked):
            S   = qh_block @ K_tile^T               BLAS, [KVH, rows, L] (SCORE_BYTES: in L2 / L3)
            softmax_tile: per row, under the causal / window mask
                m' = max(m, max S),  P = exp(S - m'),  c = exp(m - m'),  l = c l + sum P,  acc *= c
            acc += P @ V_tile                       BLAS
        out[block] = acc / l

The whole-context version (reference.backend._attend_one, the reference) built S for every key at once: at 16K
tokens of context a 512-token chunk's scores were [2, 3584, 16384] float32, 470 MB, written and read by
single-threaded numpy passes. Key tiles over the whole chunk (the first version of this file) bounded that,
but a 2K-token chunk's 14K rows still made every tile's scores 7 MB and more (out of L2, each pass to memory)
and computed the half of the scores the causal mask then zeroed. Query blocks keep a tile's scores and the
block's accumulators in cache and leave out the tiles a block cannot see. The softmax is one parallel pass
(`fast_exp`, a polynomial LLVM vectorises: numba's exp is a scalar libm call without SVML).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from engine.backends.cpu.gguf_row_kernels import call_kernel
from engine.batch import SeqSlice
from engine.kv_quant import split_rows

_F32, _U64 = np.float32, np.uint64
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}  # no nnan / ninf: -inf marks masked keys
SCORE_BYTES = 4 * 2**20  # one tile's scores (both K/V heads): about L2's size, and nothing near the context's
QUERY_ROWS = 1024  # rows of a query block: 2 K/V heads' accumulators of hd 64 are 512 KiB
MIN_KEY_TILE = 128  # below this BLAS's calls get short and the Python loop long
_NEG_INF = _F32(-np.inf)
_LOG2E, _LN2_HI, _LN2_LO = _F32(1.4426950408889634), _F32(0.693145751953125), _F32(1.428606765330187e-06)


@intrinsic
def _float_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _maxnum(typingctx, a, b):
    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType(), ir.FloatType()])
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.maxnum.f32"), args)
    return types.float32(types.float32, types.float32), codegen


@njit(inline="always", fastmath=_FASTMATH)
def fast_exp(x):
    """exp(x) for float32 x <= 0 (x = -inf gives a denormal-free tiny value, not 0: mask before calling):
    2^k * p(r), r = x - k ln 2 in [-ln2 / 2, ln2 / 2], p Taylor to degree 6 (relative error < 2e-7)."""
    x = x if not x < _F32(-87.0) else _F32(-87.0)  # NaN stays NaN
    k = np.floor(x * _LOG2E + _F32(0.5))
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = _F32(1.0 / 720.0)
    p = p * r + _F32(1.0 / 120.0)
    p = p * r + _F32(1.0 / 24.0)
    p = p * r + _F32(1.0 / 6.0)
    p = p * r + _F32(0.5)
    p = p * r + _F32(1.0)
    p = p * r + _F32(1.0)
    return p * _float_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def softmax_tile(s, m, l, acc, group, pos0, key_start, window):
    """One key tile's online-softmax step, in place. s [KVH, M, L] scores -> probabilities (0 where masked);
    m, l [KVH, M] the running max and sum; acc [KVH, M, hd] scaled by exp(m_old - m_new). Row r of a head
    is the block's token r // group (position pos0 + r // group); key c is at position key_start + c;
    masked: keys after the query, or window > 0 and at or before query - window."""
    kvh, rows, keys = s.shape
    for task in prange(kvh * rows):
        h, r = task // rows, task % rows
        pos = pos0 + r // group
        first = min(keys, max(0, pos - window + 1 - key_start)) if window > 0 else 0
        last = max(first, min(keys, pos + 1 - key_start))  # keys first .. last - 1 are visible
        # unsigned indices: numba wraps a negative signed index around, and that select made LLVM gather and
        # scatter instead of vectorising the row loops (4-5 ns a score; 0.5 now)
        _row_step(s, _U64(first), _U64(last), m, l, acc, _U64(h), _U64(r))


@njit(inline="always", fastmath=_FASTMATH)
def _row_step(s, first, last, m, l, acc, h, r):
    """Row r of head h: the row loops of softmax_tile."""
    for c in range(first):
        s[h, r, c] = _F32(0.0)
    for c in range(last, _U64(s.shape[2])):
        s[h, r, c] = _F32(0.0)
    run_max = _NEG_INF
    for c in range(first, last):
        run_max = _maxnum(run_max, s[h, r, c])  # llvm.maxnum: a vector reduction (a select-based max is not one)
    m_old = m[h, r]
    m_new = _maxnum(m_old, run_max)
    if m_new == _NEG_INF:  # nothing visible yet: no probabilities, state unchanged
        return
    total = _F32(0.0)
    for c in range(first, last):
        p = fast_exp(s[h, r, c] - m_new)
        s[h, r, c] = p
        total += p
    corr = fast_exp(m_old - m_new) if m_old != _NEG_INF else _F32(0.0)
    m[h, r], l[h, r] = m_new, l[h, r] * corr + total
    for d in range(_U64(acc.shape[2])):
        acc[h, r, d] *= corr


def key_tile(rows: int) -> int:
    """Keys a tile holds for `rows` query rows per K/V head (both heads' scores within SCORE_BYTES)."""
    return max(MIN_KEY_TILE, SCORE_BYTES // (4 * max(1, rows)) // 2)


def attend_tiled(q, k_layer, v_layer, seq: SeqSlice, block_size: int, scale, window: int, sinks=None):
    """Attention for one sequence's new tokens q [n, H, hd] -> [n, H * hd], as reference.backend._attend_one
    computes it (the same masks, sinks and int8 scales), query block by query block, key tile by key tile."""
    n, n_heads, head_dim = q.shape
    n_kv = k_layer.shape[0]
    group = n_heads // n_kv
    qh = (q * _F32(scale)).reshape(n, n_kv, group, head_dim).transpose(1, 0, 2, 3).reshape(n_kv, n * group, head_dim)
    out = np.empty((n_kv, n * group, head_dim), _F32)
    block_tokens = max(1, QUERY_ROWS // group)
    for t0 in range(0, n, block_tokens):
        t1 = min(n, t0 + block_tokens)
        rows = slice(t0 * group, t1 * group)
        out[:, rows] = _attend_block(np.ascontiguousarray(qh[:, rows]), k_layer, v_layer, seq, block_size, window,
                                     group, seq.start_pos + t0, seq.start_pos + t1, sinks)
    return out.reshape(n_kv, n, group, head_dim).transpose(1, 0, 2, 3).reshape(n, n_heads * head_dim)


def _attend_block(qb, k_layer, v_layer, seq: SeqSlice, block_size: int, window: int, group: int, pos0: int,
                  pos_end: int, sinks):
    """Rows of tokens at positions pos0 .. pos_end - 1 (qb [KVH, rows, hd], scaled) -> [KVH, rows, hd]."""
    n_kv, rows, head_dim = qb.shape
    m = np.full((n_kv, rows), -np.inf, _F32)
    l = np.zeros((n_kv, rows), _F32)
    acc = np.zeros((n_kv, rows, head_dim), _F32)
    first_key = max(0, pos0 - window + 1) if window else 0  # the block's first token sees nothing earlier
    tile = key_tile(rows)
    for run_start, run_len, run_slot in seq.key_runs(block_size, first_key):
        run_len = min(run_len, pos_end - run_start)  # keys after the block's last token: nobody sees them
        for offset in range(0, run_len, tile):
            key_start, key_len, slot = run_start + offset, min(tile, run_len - offset), run_slot + offset
            keys, k_scale = split_rows(k_layer[:, slot : slot + key_len, :], head_dim)  # [KVH, L, hd], [KVH, L]
            values, v_scale = split_rows(v_layer[:, slot : slot + key_len, :], head_dim)
            s = np.matmul(qb, keys.astype(_F32).transpose(0, 2, 1))  # [KVH, rows, L]
            if k_scale is not None:  # int8: q . (k * s) = (q . k) * s
                s *= k_scale[:, None, :]
            call_kernel(softmax_tile, s, m, l, acc, group, pos0, key_start, window)
            if v_scale is not None:  # int8: p . (v * s) = (p * s) . v
                s *= v_scale[:, None, :]
            acc += np.matmul(s, values.astype(_F32))
    if sinks is not None:  # one more logit per head, with no value (gpt-oss); row r is head r % group
        sink = np.tile(np.asarray(sinks, _F32).reshape(n_kv, 1, group), (1, rows // group, 1)).reshape(n_kv, rows)
        m_new = np.maximum(m, sink)
        correction = np.exp(m - m_new)
        l, acc = l * correction + np.exp(sink - m_new), acc * correction[..., None]
    return acc / l[..., None]
