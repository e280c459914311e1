"""A whole decode step, every layer and the output head, in one numba call and one parallel region.

For T <= 8 sequences of one new token each, per layer:

    x [T, d] (the residual stream)
      h    = rmsnorm(x, attn_norm)                                      phase PREP      (1 unit)
      qkv  = h @ Wqkv.T                                                 phase QKV       (16-row units)
      q, k = (+ bias) per-head rmsnorm (qwen3, gemma3); RoPE; q *= scale;
             K/V pool[slot] = k, v                                      phase HEADS     (a unit a head)
      a    = softmax(q . K) V over the paged keys (sliding layers: the window)  ATTN    (a unit: query heads of one K/V head)
      a    -> activations of the Wo product                             phase PREP_O    (1 unit)
      o    = a @ Wo.T                                                   phase WO
      x   += post_attn_norm?(o);  h = rmsnorm(x, ffn_norm)              phase PREP_FFN  (1 unit)
      g|u  = h @ Wgate_up.T                                             phase GATE_UP
      f    = act(g) * u                                                 phase ACT       (256-element units)
      o    = f @ Wdown.T                                                phase DOWN
    and x += post_ffn_norm?(o) in the next layer's PREP; then the output norm and the head (HEAD).

The same float32 operations as engine/model.py on the numpy backend. Each of the region's workers (one a
kernel thread) walks the phases claiming units (cpu/step_sync.py), so the whole step costs one wake-up of the
thread pool and one Python dispatch, where a call per layer with a region per product cost 121 wake-ups
(69 us each with sleeping threads) and 30 dispatches of ~50 arguments (about 110 us each) a SmolLM2 token.
Attention runs a query head a unit, on every worker.

Linears are in one of two forms (fused_layer.product_rows): raw rows (float activations) or repacked
parts (integer activations); numba compiles one version of this function per form.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends.cpu.fused_layer import (activate_span, add_normed, attend_heads, fill_act, fill_act_span,
                                             heads_per_unit,
                                             linear_rows, new_act, product_rows, rms_norm_into, rope)
from engine.backends.cpu.half import kv_store
from engine.backends.cpu.numba_cache_deps import key_on_sources
from engine.backends.cpu.step_sync import STRIDE, claim, claim_end, unit_done, wait_phase

_F32 = np.float32
_FASTMATH = {"reassoc", "contract", "nsz"}
PREP, QKV, HEADS, ATTN, PREP_O, WO, PREP_FFN, GATE_UP, ACT, DOWN = range(10)
PHASES_PER_LAYER = 10
_UNIT_WEIGHTS = 32768  # weights a product unit covers at least (16 rows of SmolLM2's 576 inputs)
# Elements of one token's FFN activation a unit of ACT covers (a multiple of 32: whole activation blocks).
# One unit a step was 12% of a 4-token SmolLM2 step on one worker while the other waited (session 7).
ACT_SPAN = 256


@njit(cache=True)
def _unit_rows(n_in):
    """Rows a product unit covers: 16, more for narrow inputs (each claim is an atomic operation)."""
    return max(16, (_UNIT_WEIGHTS // n_in + 15) // 16 * 16)


@njit(cache=True)
def _units(linear, n_in):
    n0, n1 = linear_rows(linear)
    r = _unit_rows(n_in)
    return (n0 + r - 1) // r + (n1 + r - 1) // r


@njit(cache=True)
def _total_rows(linear):
    n0, n1 = linear_rows(linear)
    return n0 + n1


@njit(cache=True, fastmath=_FASTMATH)
def _residual_then_norm(x, delta, post_norm, add, norm, h, eps):
    """x += post_norm?(delta) when `add`, then h = rmsnorm(x, norm), row by row."""
    if add:
        add_normed(x, delta, post_norm, eps)
    for t in range(x.shape[0]):
        rms_norm_into(x[t], norm, h[t], eps)


@njit(cache=True, fastmath=_FASTMATH)
def _heads(u, layer, qkv, q, k_pool, v_pool, positions, slots, cos, sin, rope_dims, n_heads, n_kv_heads, scale,
           eps):
    """Unit u of HEADS: query head (t, h) into q, or key/value head (t, kvh) into the pool at slots[t]."""
    bqkv, q_norm, k_norm = layer[1], layer[2], layer[3]
    hd = k_pool.shape[2]
    per_token = n_heads + n_kv_heads
    t, head = u // per_token, u % per_token
    q_dim, kv_dim = n_heads * hd, n_kv_heads * hd
    at = head * hd
    v = qkv[t, at : at + hd]
    if bqkv.size:
        for j in range(hd):
            v[j] += bqkv[at + j]
    if q_norm.size:
        rms_norm_into(v, q_norm if head < n_heads else k_norm, v, eps)
    rope(v, cos, sin, positions[t], rope_dims)
    if head < n_heads:
        for j in range(hd):
            q[t, at + j] = v[j] * scale
        return
    kvh, slot = head - n_heads, slots[t]
    vat = q_dim + kv_dim + kvh * hd
    for j in range(hd):
        k_pool[kvh, slot, j] = kv_store(v[j], k_pool[0, 0, 0])
        value = qkv[t, vat + j]
        if bqkv.size:
            value += bqkv[vat + j]
        v_pool[kvh, slot, j] = kv_store(value, v_pool[0, 0, 0])


@njit(cache=True, fastmath=_FASTMATH)
def _product(linear, phase, counters, n_units, x, act, y, table, lanes, worker):
    """Claim and compute units of one product until none is left, then wait for the phase to finish; odd
    workers take units from the back (step_sync.claim_end)."""
    rows = _unit_rows(x.shape[1])
    back = worker % 2 == 1
    u = claim_end(counters, phase, n_units, back)
    while u >= 0:
        product_rows(linear, u, rows, x, act, y, table, lanes)
        unit_done(counters, phase)
        u = claim_end(counters, phase, n_units, back)
    wait_phase(counters, phase, n_units)


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def decode_step(x, layers, linears, windows, local_rope, rope_tables, head, output_norm, logit_rows, k_pool,
                v_pool, positions, slots, tables, block_size, rope_dims, n_heads, n_kv_heads, scale, eps, act_kind,
                table, lanes, qmax, n_workers):
    """Logits [len(logit_rows), vocab] for x [T, d] (the step's embedded tokens, overwritten).

    layers: a typed List of (attn_norm, bqkv, q_norm, k_norm, post_attn_norm, ffn_norm, post_ffn_norm) per
    layer; linears: a typed List of (wqkv, wo, w_gate_up, w_down) per layer, all of one form, and `head` a
    typed List of the output linear (a List: a tuple of tuples of arrays cannot enter a parallel region);
    windows [L] int64 (0: global attention); local_rope [L] bool picks rope_tables' (cos, sin, cos_local,
    sin_local) pair; k_pool / v_pool [L, KVH, slots, hd] float32, or uint16 views of a float16 pool
    (cpu/half.py); tables [T, max_blocks] int64; n_workers:
    numba.get_num_threads() (an argument: read inside, it would keep numba from caching this function)."""
    n_tok, d = x.shape
    n_layers = len(layers)
    output = head[0]
    hd = k_pool.shape[3]
    q_dim = n_heads * hd
    wqkv0, _, w_gate_up0, _ = linears[0]
    n_qkv = _total_rows(wqkv0)
    n_ff = _total_rows(w_gate_up0) // 2
    n_vocab = _total_rows(output)
    n_out = logit_rows.shape[0]
    # shared buffers, written by whichever worker runs a unit
    h, delta = np.empty((n_tok, d), np.float32), np.empty((n_tok, d), np.float32)
    qkv, q = np.empty((n_tok, n_qkv), np.float32), np.empty((n_tok, q_dim), np.float32)
    attn = np.empty((n_tok, q_dim), np.float32)
    gate_up, hidden = np.empty((n_tok, 2 * n_ff), np.float32), np.empty((n_tok, n_ff), np.float32)
    h_out, logits = np.empty((n_out, d), np.float32), np.empty((n_out, n_vocab), np.float32)
    act_d, act_q, act_f = new_act(wqkv0, n_tok, d), new_act(wqkv0, n_tok, q_dim), new_act(wqkv0, n_tok, n_ff)
    act_out = new_act(output, n_out, d)
    counters = np.zeros((PHASES_PER_LAYER * n_layers + 2) * STRIDE, np.int64)
    u_qkv, u_wo = _units(wqkv0, d), _units(linears[0][1], q_dim)
    u_gu, u_down = _units(w_gate_up0, d), _units(linears[0][3], n_ff)
    u_head = _units(output, d)
    group = n_heads // n_kv_heads
    attn_heads = heads_per_unit(n_tok, n_heads, n_kv_heads, n_workers)  # query heads an attention unit
    units_a_token = n_heads // attn_heads
    u_attn = n_tok * units_a_token
    act_spans = (n_ff + ACT_SPAN - 1) // ACT_SPAN
    u_act = n_tok * act_spans
    for worker in prange(n_workers):
        for li in range(n_layers):
            layer, (wqkv, wo, w_gate_up, w_down) = layers[li], linears[li]
            base = li * PHASES_PER_LAYER
            k_l, v_l = k_pool[li], v_pool[li]
            if claim(counters, base + PREP, 1) == 0:
                _residual_then_norm(x, delta, layers[li - 1][6] if li > 0 else layer[6], li > 0, layer[0], h, eps)
                fill_act(wqkv, h, qmax, act_d)
                unit_done(counters, base + PREP)
            wait_phase(counters, base + PREP, 1)
            _product(wqkv, base + QKV, counters, u_qkv, h, act_d, qkv, table, lanes, worker)
            cos = rope_tables[2] if local_rope[li] else rope_tables[0]
            sin = rope_tables[3] if local_rope[li] else rope_tables[1]
            n_units = n_tok * (n_heads + n_kv_heads)
            u = claim(counters, base + HEADS, n_units)
            while u >= 0:
                _heads(u, layer, qkv, q, k_l, v_l, positions, slots, cos, sin, rope_dims, n_heads, n_kv_heads,
                       scale, eps)
                unit_done(counters, base + HEADS)
                u = claim(counters, base + HEADS, n_units)
            wait_phase(counters, base + HEADS, n_units)
            u = claim(counters, base + ATTN, u_attn)
            while u >= 0:
                t, h0 = u // units_a_token, (u % units_a_token) * attn_heads
                attend_heads(q[t], h0, attn_heads, k_l, v_l, h0 // group, positions[t], tables[t], block_size,
                             windows[li], attn[t])
                unit_done(counters, base + ATTN)
                u = claim(counters, base + ATTN, u_attn)
            wait_phase(counters, base + ATTN, u_attn)
            if claim(counters, base + PREP_O, 1) == 0:
                fill_act(wo, attn, qmax, act_q)
                unit_done(counters, base + PREP_O)
            wait_phase(counters, base + PREP_O, 1)
            _product(wo, base + WO, counters, u_wo, attn, act_q, delta, table, lanes, worker)
            if claim(counters, base + PREP_FFN, 1) == 0:
                _residual_then_norm(x, delta, layer[4], True, layer[5], h, eps)
                fill_act(w_gate_up, h, qmax, act_d)
                unit_done(counters, base + PREP_FFN)
            wait_phase(counters, base + PREP_FFN, 1)
            _product(w_gate_up, base + GATE_UP, counters, u_gu, h, act_d, gate_up, table, lanes, worker)
            u = claim(counters, base + ACT, u_act)
            while u >= 0:
                t, first = u // act_spans, u % act_spans * ACT_SPAN
                last = min(n_ff, first + ACT_SPAN)
                activate_span(gate_up, act_kind, hidden, t, first, last)
                fill_act_span(w_down, hidden, qmax, act_f, t, first, last)
                unit_done(counters, base + ACT)
                u = claim(counters, base + ACT, u_act)
            wait_phase(counters, base + ACT, u_act)
            _product(w_down, base + DOWN, counters, u_down, hidden, act_f, delta, table, lanes, worker)
        last = n_layers * PHASES_PER_LAYER
        if claim(counters, last, 1) == 0:
            add_normed(x, delta, layers[n_layers - 1][6], eps)
            for i in range(n_out):
                rms_norm_into(x[logit_rows[i]], output_norm, h_out[i], eps)
            fill_act(head[0], h_out, qmax, act_out)
            unit_done(counters, last)
        wait_phase(counters, last, 1)
        _product(head[0], last + 1, counters, u_head, h_out, act_out, logits, table, lanes, worker)
    return logits


# numba caches each function against this file only; the jitted code it calls in from these modules is
# compiled into its entries, so their sources key the cache too.
key_on_sources(globals(), ["engine.backends.cpu.fused_layer", "engine.backends.cpu.fused_matvec",
                           "engine.backends.cpu.int8_matvec", "engine.backends.cpu.int8_repack",
                           "engine.backends.cpu.gguf_dequant", "engine.backends.cpu.step_sync",
                           "engine.backends.cpu.half", "engine.backends.cpu.repacked_rows",
                           "engine.backends.cpu.simd_dot", "engine.backends.cpu.llvm_ir"])
