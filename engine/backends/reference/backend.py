"""The numpy backend: the reference implementation of every op, float32 throughout.

Speed notes (2-core CPU, OpenBLAS): weights stay [out, in] (C-contiguous); Q/K/V and gate/up are fused
by the model loader, so a step is one BLAS call per projection. For a few rows (decode) the product is
computed as W @ x.T: OpenBLAS's sgemm micro-kernels tile the M dimension by 16 or more, so x @ W.T with
M = 2..8 wastes most of each tile and runs 3-5x slower than M = 1, while W @ x.T puts the few rows on
the narrow side of the tile (measured in docs/BENCHMARKS.md). Large M (prefill) uses x @ W.T. Attention reads each
sequence's context as a few contiguous views of the pool (one per run of consecutive blocks) and merges
them with an online softmax, so a decode step copies nothing proportional to the context length.
Every scalar is np.float32: a Python float times a float32 array stays float32, but a float64 numpy
scalar would silently promote the whole activation to float64.
"""
from __future__ import annotations

import math
from concurrent.futures import Executor

import numpy as np

from engine.backends.capabilities import ATTENTION, DELTA_NET, SHORT_CONV, Capabilities
from engine.backends.page_release import avoid_huge_pages, release_pages
from engine.backends.reference import moe as numpy_moe
from engine.backends.reference.host_pool import NumpyHostPool
from engine.backends.step_runner import ThreadStepRunner
from engine.batch import BatchMeta, SeqSlice
from engine.kv import KVLayout
from engine.kv_quant import encode_rows, split_rows
from engine.moe_config import OAI_SWIGLU_ALPHA, OAI_SWIGLU_LIMIT
from engine.short_conv import ConvStatePool, numpy_short_conv

_F32 = np.float32
_GELU_C = _F32(math.sqrt(2.0 / math.pi))
_FEW_ROWS = 16  # up to this many rows a linear runs as W @ x.T (see the module docstring)
_OAI_ALPHA, _OAI_LIMIT = _F32(OAI_SWIGLU_ALPHA), _F32(OAI_SWIGLU_LIMIT)


class NumpyKVPool:
    """K and V for all layers: k[layer] is [KVH, num_slots, row] so a run of blocks is one view per head.

    A row is one token's stored K (or V) of one head in the layout's --kv-type (engine/kv_quant.py):
    hd float32 or float16 values, or hd int8 values followed by their float32 scale."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        shape = (layout.n_layers, layout.n_kv_heads, layout.num_slots, layout.row_elems)
        self.k = np.zeros(shape, dtype=layout.dtype)
        self.v = np.zeros(shape, dtype=layout.dtype)
        avoid_huge_pages(self.k)  # pages are committed as blocks are written, not 2 MiB at a time
        avoid_huge_pages(self.v)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def release_from(self, num_blocks: int) -> int:
        """Give the memory of blocks num_blocks and up back to the OS (their contents read as zeros later)."""
        start = num_blocks * self.layout.block_size
        return sum(release_pages(pool[layer, head, start:]) for pool in (self.k, self.v)
                   for layer in range(pool.shape[0]) for head in range(pool.shape[1]))


class NumpyBackend:
    """Backend protocol on numpy arrays (see engine/backends/base.py)."""

    name = "numpy"
    capabilities = Capabilities(
        # --kv-type auto: the first. f16: half the bytes, greedy ids as f32 on every reference prompt, and on the
        # fused decode step (cpu/fused_step.py) faster at long contexts; prefill level (docs/BENCHMARKS.md)
        kv_types=("f16", "f32", "int8"),
        writes_kv_rows=True,  # store_kv honours batch.kv_write_rows: hybrid models may recompute state windows
        moe=True, attention_sinks=True, layer_kinds=frozenset({ATTENTION, SHORT_CONV, DELTA_NET}))

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array, dtype=_F32)

    def upload_linear(self, weight: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(weight, dtype=_F32)  # [out, in]

    def create_kv_pool(self, layout: KVLayout, mapped_blocks: int | None = None) -> NumpyKVPool:
        return NumpyKVPool(layout)  # elastic or not: calloc's pages are committed only as they are touched

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    def copy_blocks(self, pool: NumpyKVPool, pairs: list[tuple[int, int]]) -> None:
        _copy_between(pool, pool, pairs)

    def create_host_pool(self, layout: KVLayout) -> NumpyHostPool:
        return NumpyHostPool(layout)

    def grow_host_pool(self, host_pool: NumpyHostPool, num_blocks: int) -> None:
        host_pool.grow(num_blocks)

    def release_kv_blocks(self, pool: NumpyKVPool, num_blocks: int) -> None:
        pool.release_from(num_blocks)

    def park_blocks(self, pool: NumpyKVPool, host_pool: NumpyHostPool, pairs: list[tuple[int, int]]) -> None:
        for block, slot in pairs:
            for dst, src in zip(_block_views(host_pool, slot), _block_views(pool, block)):
                dst[...] = src

    def restore_blocks(self, host_pool: NumpyHostPool, pool: NumpyKVPool, pairs: list[tuple[int, int]]) -> None:
        for slot, block in pairs:
            for dst, src in zip(_block_views(pool, block), _block_views(host_pool, slot)):
                dst[...] = src

    def read_block(self, pool, block: int):
        k, v = _block_views(pool, block)
        return k.copy(), v.copy()

    def write_block(self, pool, block: int, k: np.ndarray, v: np.ndarray) -> None:
        dst_k, dst_v = _block_views(pool, block)
        dst_k[...], dst_v[...] = k, v

    def embedding(self, table: np.ndarray, token_ids: np.ndarray, scale: float) -> np.ndarray:
        rows = table[token_ids]  # [T, d]
        if scale != 1.0:
            rows *= _F32(scale)
        return rows

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        mean_sq = np.einsum("...i,...i->...", x, x)[..., None] / _F32(x.shape[-1])
        return x * (1.0 / np.sqrt(mean_sq + _F32(eps))) * weight

    def add_rms_norm(self, x, delta, weight, eps):
        total = x + delta
        return total, self.rms_norm(total, weight, eps)

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        if 1 < x.shape[0] <= _FEW_ROWS:
            y = np.ascontiguousarray((weight @ x.T).T)
        else:
            y = x @ weight.T
        if bias is not None:
            y += bias
        return y

    def split_heads(self, x: np.ndarray, sizes: tuple[int, ...], head_dim: int) -> tuple[np.ndarray, ...]:
        bounds = np.cumsum((0,) + tuple(sizes))
        return tuple(x[:, a:b].reshape(x.shape[0], (b - a) // head_dim, head_dim) for a, b in zip(bounds, bounds[1:]))

    def rope(self, x: np.ndarray, positions: np.ndarray, cos_sin, rope_dims: int) -> np.ndarray:
        cos_table, sin_table = cos_sin
        half = rope_dims // 2
        cos = cos_table[positions][:, None, :]  # [T, 1, half]
        sin = sin_table[positions][:, None, :]
        x1, x2 = x[..., :half], x[..., half:rope_dims]
        rotated = np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)
        if rope_dims == x.shape[-1]:
            return rotated
        return np.concatenate((rotated, x[..., rope_dims:]), axis=-1)

    def store_kv(self, pool: NumpyKVPool, layer: int, k: np.ndarray, v: np.ndarray, batch: BatchMeta) -> None:
        # k, v: [T, KVH, hd] -> rows [T, KVH, row] (quantised for int8) -> pool[layer][:, slot, :]
        kv_type, slots, rows = pool.layout.kv_type, batch.slot_mapping, batch.kv_write_rows
        if rows is not None:  # a state window's rows write nothing (engine/state_window.py)
            k, v, slots = k[rows], v[rows], slots[rows]
        pool.k[layer][:, slots, :] = encode_rows(k, kv_type).transpose(1, 0, 2)
        pool.v[layer][:, slots, :] = encode_rows(v, kv_type).transpose(1, 0, 2)

    def attention(self, q, pool: NumpyKVPool, layer: int, batch: BatchMeta, scale: float, window: int,
                  sinks: np.ndarray | None = None):
        out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=_F32)
        k_layer, v_layer = pool.k[layer], pool.v[layer]
        for seq in batch.seqs:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = _attend_one(q[rows], k_layer, v_layer, seq, batch.block_size, _F32(scale), window, sinks)
        return out

    def gated_activation(self, gate_up: np.ndarray, kind: str) -> np.ndarray:
        half = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :half], gate_up[:, half:]
        if kind == "silu":
            return gate / (1.0 + np.exp(-gate)) * up
        if kind == "gelu_tanh":
            return 0.5 * gate * (1.0 + np.tanh(_GELU_C * (gate + _F32(0.044715) * gate * gate * gate))) * up
        if kind == "swiglu_oai":  # gpt-oss: gate clamped above, up clamped both ways, (up + 1)
            gate, up = np.minimum(gate, _OAI_LIMIT), np.clip(up, -_OAI_LIMIT, _OAI_LIMIT)
            return gate / (1.0 + np.exp(-_OAI_ALPHA * gate)) * (up + _F32(1.0))
        raise ValueError(f"unknown activation {kind!r}")

    # -- lfm2's short convolution (engine/short_conv.py): the states are host arrays --
    create_state_pool = staticmethod(ConvStatePool)  # (layers, kernel, d_model)
    short_conv = staticmethod(numpy_short_conv)  # (u, kernel, pool, layer, batch)

    # -- mixture of experts (engine/moe.py; the math is in reference/moe.py) --
    def route_experts(self, logits: np.ndarray, k: int, gating: str, normalize: bool):
        return numpy_moe.route_experts(logits, k, gating, normalize)

    def expert_ffn(self, h: np.ndarray, moe, ids: np.ndarray, weights: np.ndarray, activation: str) -> np.ndarray:
        return numpy_moe.expert_ffn(self, h, moe, ids, weights, activation)

    def gather_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        if len(rows) == x.shape[0]:
            return x
        return x[rows]

    # -- pipeline stages: numpy has no per-thread state, so every stage and thread shares this object --
    def for_stage(self, stage: int) -> "NumpyBackend":
        return self

    def sibling(self) -> "NumpyBackend":
        return self

    def send_hidden(self, hidden: tuple) -> tuple:
        return hidden  # the next stage only reads the arrays; this stage's next job makes new ones

    def receive_hidden(self, hidden: tuple, batch: BatchMeta) -> tuple:
        return hidden

    def run_forward(self, model, batch: BatchMeta, pool: NumpyKVPool) -> np.ndarray:
        return model.forward(batch, pool)

    def prepare_decode(self, model) -> None:
        pass  # the reference decodes with model.forward: nothing to build ahead

    def create_step_runner(self, worker: Executor) -> ThreadStepRunner:
        return ThreadStepRunner(worker)  # the computation itself blocks the stage's worker thread


def _block_views(pool, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Views (K, V) [layers, KVH, B, hd] of one block of a device pool or a host pool (any may be either)."""
    if isinstance(pool, NumpyHostPool):
        return pool.block(block)
    B = pool.layout.block_size
    return pool.k[:, :, block * B : (block + 1) * B, :], pool.v[:, :, block * B : (block + 1) * B, :]


def _copy_between(src_pool: NumpyKVPool, dst_pool: NumpyKVPool, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks (all layers, K and V) from src_pool block a to dst_pool block b, per (a, b)."""
    B = src_pool.layout.block_size
    for src, dst in pairs:
        for s_arr, d_arr in ((src_pool.k, dst_pool.k), (src_pool.v, dst_pool.v)):
            d_arr[:, :, dst * B : (dst + 1) * B, :] = s_arr[:, :, src * B : (src + 1) * B, :]


def _attend_one(q, k_layer, v_layer, seq: SeqSlice, block_size: int, scale, window: int, sinks=None) -> np.ndarray:
    """Attention for one sequence's new tokens q [n, H, hd] -> [n, H * hd], online softmax over key runs.

    sinks [H] (gpt-oss): one more logit per head in each softmax's denominator, with no value."""
    n, n_heads, head_dim = q.shape
    n_kv = k_layer.shape[0]
    group = n_heads // n_kv
    # Head h reads KV head h // group: lay queries out as [KVH, group * n, hd] for one batched matmul.
    qh = (q * scale).reshape(n, n_kv, group, head_dim).transpose(1, 2, 0, 3).reshape(n_kv, group * n, head_dim)
    q_pos = np.arange(seq.start_pos, seq.context_len)
    first_key = max(0, seq.start_pos - window + 1) if window else 0
    runs = seq.key_runs(block_size, first_key)
    m = l = acc = None
    for key_start, key_len, slot in runs:
        keys, k_scale = split_rows(k_layer[:, slot : slot + key_len, :], head_dim)  # [KVH, L, hd] view, [KVH, L]
        values, v_scale = split_rows(v_layer[:, slot : slot + key_len, :], head_dim)
        scores = qh @ _as_f32(keys).transpose(0, 2, 1)  # [KVH, group * n, L]
        if k_scale is not None:  # int8: q . (k * s) = (q . k) * s, one multiply per score, not per element
            scores *= k_scale[:, None, :]
        _mask_in_place(scores, q_pos, key_start, key_len, window, group)
        run_max = scores.max(axis=-1, keepdims=True)
        if m is None:
            m_new = run_max
        else:
            m_new = np.maximum(m, run_max)
        m_safe = np.where(np.isneginf(m_new), _F32(0.0), m_new)
        probs = np.exp(scores - m_safe, out=scores)
        run_sum = probs.sum(axis=-1, keepdims=True)
        weighted = probs if v_scale is None else probs * v_scale[:, None, :]  # int8: p . (v * s) = (p * s) . v
        if m is None:
            l, acc = run_sum, weighted @ _as_f32(values)
        else:
            correction = np.exp(m - m_safe)
            l = l * correction + run_sum
            acc = acc * correction + weighted @ _as_f32(values)
        m = m_new
    if sinks is not None:  # the sink joins as a last "run" of one key whose value is zero
        sink = np.repeat(np.asarray(sinks, dtype=_F32).reshape(n_kv, group, 1), n, axis=1).reshape(n_kv, group * n, 1)
        m_new = np.maximum(m, sink)
        correction = np.exp(m - m_new)
        l, acc = l * correction + np.exp(sink - m_new), acc * correction
    out = acc / l  # [KVH, group * n, hd]
    return out.reshape(n_kv, group, n, head_dim).transpose(2, 0, 1, 3).reshape(n, n_heads * head_dim)


def _as_f32(x: np.ndarray) -> np.ndarray:
    """A run of stored values as float32: the f32 pool's view itself, a converted copy of f16 / int8."""
    return x if x.dtype == _F32 else x.astype(_F32)


def _mask_in_place(scores, q_pos, key_start: int, key_len: int, window: int, group: int) -> None:
    """Set scores of keys after the query (causal) or outside its window to -inf. No-op when none are."""
    key_last = key_start + key_len - 1
    needs_causal = key_last > q_pos[0]
    needs_window = window and key_start <= q_pos[-1] - window
    if not (needs_causal or needs_window):
        return
    k_pos = np.arange(key_start, key_start + key_len)
    hidden = k_pos[None, :] > q_pos[:, None]  # [n, L]
    if window:
        hidden |= k_pos[None, :] <= q_pos[:, None] - window
    n = len(q_pos)
    view = scores.reshape(scores.shape[0], group, n, key_len)
    view[:, :, hidden] = -np.inf
