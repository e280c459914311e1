"""One whole decode layer in one compiled call (numba), for T <= 8 sequences of one new token each.

    x [T, d] (the residual stream, updated in place)
      h    = rmsnorm(x, attn_norm)
      qkv  = h @ Wqkv.T (+ bias)                      parallel region 1 (`project`: cpu_fused_matvec or cpu_int8_matvec)
      q, k = per-head rmsnorm (qwen3, gemma3); RoPE (half-split); q *= attn_scale
      K/V pool[slot] = k, v
      a    = softmax(q . K) V over the sequence's paged keys (its window on sliding layers), serial
      x   += post_attn_norm?(a @ Wo.T)                region 2
      h    = rmsnorm(x, ffn_norm)
      x   += post_ffn_norm?(act(gate) * up  @ Wdown.T)  regions 3 (gate_up) and 4 (down)

The same float32 operations as engine/model.py on the numpy backend, in one call instead of ~15 numpy
and numba calls per layer (each a Python dispatch, several a wake-up of the thread pool). An optional
weight (bias, QK-norm, post norms) is passed as a 0-length array when the model has none.
numba's disk cache is keyed on this file and on the kernel files whose code it inlines (the decoders, the
float and integer matvecs: engine/backends/numba_cache_deps.py), so an edit to any of them recompiles it.
Decoders: f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k mxfp4.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba.core import types
from numba.extending import overload

from engine.backends.cpu_fused_matvec import block_sums, matvec2
from engine.backends.cpu_int8_matvec import project_i8
from engine.backends.numba_cache_deps import key_on_sources

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
def _rope(v, cos, sin, pos, rope_dims):
    """Rotate v[:rope_dims] in place by position pos, half-split (NeoX) pairs (i, i + rope_dims / 2)."""
    half = rope_dims // 2
    for i in range(half):
        c, s = cos[pos, i], sin[pos, i]
        a, b = v[i], v[i + half]
        v[i] = a * c - b * s
        v[i + half] = b * c + a * s


@njit(cache=True, fastmath=_FASTMATH)
def _attend_one(q, k_pool, v_pool, kv_head, pos, table_row, block_size, window, out):
    """out [hd] = softmax(q . keys) values over key positions first .. pos of one sequence (q pre-scaled)."""
    first = max(0, pos - window + 1) if window > 0 else 0
    n = pos + 1 - first
    scores = np.empty(n, np.float32)
    best = -np.inf
    for i in range(n):
        p = first + i
        slot = table_row[p // block_size] * block_size + p % block_size
        s = _F32(0.0)
        for j in range(q.size):
            s += q[j] * k_pool[kv_head, slot, j]
        scores[i] = s
        best = max(best, s)
    total = _F32(0.0)
    acc = np.zeros(out.size, np.float32)  # contiguous: a slice of a 2-D array is typed 'A' (strided) by numba
    for i in range(n):
        p = first + i
        slot = table_row[p // block_size] * block_size + p % block_size
        e = np.exp(scores[i] - best)
        total += e
        for j in range(acc.size):
            acc[j] += e * v_pool[kv_head, slot, j]
    for j in range(out.size):
        out[j] = acc[j] / total


@njit(cache=True, fastmath=_FASTMATH)
def _attention(q, k_pool, v_pool, positions, tables, block_size, window, n_heads, group, out):
    """out [T, H * hd] for queries q [T, H * hd] (GQA: head h reads KV head h // group), on the calling thread.

    A prange over (token, head) took 7.5 ms of CPU for what costs 0.15 ms serially (SmolLM2, 4 x 129 keys;
    cause not found), so attention stays serial: ~4 us per head and 128 keys."""
    hd = k_pool.shape[2]
    for t in range(q.shape[0]):
        for h in range(n_heads):
            _attend_one(q[t, h * hd : (h + 1) * hd], k_pool, v_pool, h // group, positions[t], tables[t],
                        block_size, window, out[t, h * hd : (h + 1) * hd])


@njit(cache=True, fastmath=_FASTMATH)
def _activate(gate_up, act, out):
    """out [T, F] = act(gate) * up for gate_up [T, 2F] = (gate | up)."""
    f = out.shape[1]
    for t in range(out.shape[0]):
        for i in range(f):
            g, u = gate_up[t, i], gate_up[t, f + i]
            if act == SILU:
                out[t, i] = g / (_F32(1.0) + np.exp(-g)) * u
            else:
                inner = _GELU_C * (g + _F32(0.044715) * g * g * g)
                out[t, i] = _F32(0.5) * g * (_F32(1.0) + np.tanh(inner)) * u


@njit(cache=True, fastmath=_FASTMATH)
def _project(k0, r0, k1, r1, x, table, lanes):
    """x @ [r0; r1].T as a new [T, out] array (the block sums of x computed here)."""
    xs = np.empty((x.shape[0], x.shape[1] // 32), np.float32)
    block_sums(x, xs)
    y = np.empty((x.shape[0], r0.shape[0] + r1.shape[0]), np.float32)
    matvec2(k0, r0, k1, r1, x, xs, y, table, lanes)
    return y


def project(linear, x, table, lanes, qmax):
    """x @ W.T as a new [T, out] array, for a linear given either as raw rows (kind0, rows0, kind1, rows1)
    (float activations, cpu_fused_matvec) or as two cpu_int8_repack parts (int8 activations,
    cpu_int8_matvec, activations quantised to integers of at most qmax); numba picks the implementation from
    the tuple's type when it compiles decode_layer."""
    raise NotImplementedError("called from jitted code only")


@overload(project, jit_options={"cache": True})
def _project_typed(linear, x, table, lanes, qmax):
    if isinstance(linear, types.BaseTuple) and len(linear) == 4:
        return lambda linear, x, table, lanes, qmax: _project(linear[0], linear[1], linear[2], linear[3], x,
                                                              table, lanes)
    return lambda linear, x, table, lanes, qmax: project_i8(linear[0], linear[1], x, qmax, lanes)


@njit(cache=True, fastmath=_FASTMATH)
def _add_normed(x, delta, post_norm, eps):
    """x += post_norm ? rmsnorm(delta, post_norm) : delta, row by row (delta is overwritten)."""
    for t in range(x.shape[0]):
        if post_norm.size:
            rms_norm_into(delta[t], post_norm, delta[t], eps)
        for i in range(x.shape[1]):
            x[t, i] += delta[t, i]


@njit(cache=True, fastmath=_FASTMATH)
def decode_layer(x, attn_norm, wqkv, bqkv, q_norm, k_norm, wo, post_attn_norm, ffn_norm, w_gate_up, w_down,
                 post_ffn_norm, k_pool, v_pool, positions, slots, tables, block_size, cos, sin, rope_dims, n_heads,
                 n_kv_heads, window, scale, eps, act, table, lanes, qmax):
    """One layer for x [T, d] (one new token per row, at positions[T], K/V written to slots[T]).

    Linears are tuples `project` takes (all four of one kind: numba compiles one version per kind), qmax
    the activations' integer range for the integer kind; k_pool / v_pool [KVH, num_slots, hd] float32 are
    this layer's pool views; tables [T, max_blocks] int64 each row's block table; cos / sin [positions, hd / 2]."""
    n_tok, d = x.shape
    hd = k_pool.shape[2]
    q_dim, kv_dim = n_heads * hd, n_kv_heads * hd
    h = np.empty_like(x)
    for t in range(n_tok):
        rms_norm_into(x[t], attn_norm, h[t], eps)
    qkv = project(wqkv, h, table, lanes, qmax)  # [T, q_dim + 2 kv_dim]
    for t in range(n_tok):
        if bqkv.size:
            for i in range(qkv.shape[1]):
                qkv[t, i] += bqkv[i]
        pos = positions[t]
        for head in range(n_heads + n_kv_heads):  # query heads, then key heads
            v = qkv[t, head * hd : (head + 1) * hd]
            if q_norm.size:
                rms_norm_into(v, q_norm if head < n_heads else k_norm, v, eps)
            _rope(v, cos, sin, pos, rope_dims)
            if head < n_heads:
                for j in range(hd):
                    v[j] *= scale
        slot = slots[t]
        for kvh in range(n_kv_heads):
            for j in range(hd):
                k_pool[kvh, slot, j] = qkv[t, q_dim + kvh * hd + j]
                v_pool[kvh, slot, j] = qkv[t, q_dim + kv_dim + kvh * hd + j]
    attn = np.empty((n_tok, q_dim), np.float32)
    # A contiguous copy of the queries: numba types qkv[:, :q_dim] as strided and the dot products over it
    # did not vectorise (3.7x slower attention, gemma3 shapes, measured).
    _attention(np.ascontiguousarray(qkv[:, :q_dim]), k_pool, v_pool, positions, tables, block_size, window, n_heads,
               n_heads // n_kv_heads, attn)
    _add_normed(x, project(wo, attn, table, lanes, qmax), post_attn_norm, eps)
    for t in range(n_tok):
        rms_norm_into(x[t], ffn_norm, h[t], eps)
    gate_up = project(w_gate_up, h, table, lanes, qmax)  # [T, 2F]
    hidden = np.empty((n_tok, gate_up.shape[1] // 2), np.float32)
    _activate(gate_up, act, hidden)
    _add_normed(x, project(w_down, hidden, table, lanes, qmax), post_ffn_norm, eps)


# numba caches each function against this file only; the jitted code and constants it calls in from
# these modules are compiled into its entries, so their sources key the cache too.
key_on_sources(globals(), ["engine.backends.cpu_fused_matvec", "engine.backends.cpu_int8_matvec",
                           "engine.backends.cpu_int8_repack", "engine.backends.cpu_quant_decode"])
