"""Numpy versions of the kernels of docs/CUDA_KERNELS.md, reading and writing memory through raw addresses.

Used by tests/fake_cuda.py. Each takes (kernel name, {argument: value}) with pointers as int addresses.
"""
from __future__ import annotations

import ctypes

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from cuda_kernels.attention import num_chunks
from engine.kv import KV_TYPES
from engine.kv_quant import decode_rows, encode_rows

def view(ptr, count: int, dtype=np.float32) -> np.ndarray:
    """count elements of dtype at a real address, as a writable numpy array."""
    nbytes = int(count) * np.dtype(dtype).itemsize
    return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(int(ptr)))[:nbytes].view(dtype)


def _embedding(_, a):
    ids = view(a["ids"], a["T"], np.int32)
    table = view(a["table"], (int(ids.max()) + 1) * a["d"]).reshape(-1, a["d"])
    view(a["out"], a["T"] * a["d"]).reshape(a["T"], a["d"])[:] = table[ids] * np.float32(a["scale"])


def _norm(x, w, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float32(eps)) * w


def _rms_norm(_, a):
    x = view(a["x"], a["rows"] * a["n"]).reshape(a["rows"], a["n"])
    view(a["out"], a["rows"] * a["n"]).reshape(a["rows"], a["n"])[:] = _norm(x, view(a["w"], a["n"]), a["eps"])


def _add_rms_norm(_, a):
    size = a["rows"] * a["n"]
    total = (view(a["x"], size) + view(a["delta"], size)).reshape(a["rows"], a["n"])
    view(a["sum_out"], size)[:] = total.reshape(-1)
    view(a["norm_out"], size)[:] = _norm(total, view(a["w"], a["n"]), a["eps"]).reshape(-1)


def _add(_, a):
    view(a["out"], a["n"])[:] = view(a["a"], a["n"]) + view(a["b"], a["n"])


def _split_columns(_, a):
    x = view(a["x"], a["T"] * a["in_cols"]).reshape(a["T"], a["in_cols"])
    out = view(a["out"], a["T"] * a["out_cols"]).reshape(a["T"], a["out_cols"])
    out[:] = x[:, a["col_start"] : a["col_start"] + a["out_cols"]]


def _rope(kernel, a):
    T, H, hd, dims = a["T"], a["H"], a["hd"], a["rope_dims"]
    pos = view(a["positions"], T, np.int32)
    half = dims // 2
    cos = view(a["cos"], (int(pos.max()) + 1) * half).reshape(-1, half)[pos][:, None, :]
    sin = view(a["sin"], (int(pos.max()) + 1) * half).reshape(-1, half)[pos][:, None, :]
    x = view(a["x"], T * H * hd).reshape(T, H, hd)
    assert kernel == "rope_neox_f32", "the backend un-permutes Q/K and uses the NeoX layout only"
    x1, x2 = x[..., :half].copy(), x[..., half:dims].copy()
    x[..., :half], x[..., half:dims] = x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _kv_type(kernel: str) -> str:
    return kernel.rsplit("_", 1)[1]  # store_kv_int8 -> int8


def _pool_rows(ptr, KVH: int, S: int, hd: int, kv_type: str) -> np.ndarray:
    """One layer's stored rows [KVH, S, row] of a --kv-type (engine/kv_quant.py)."""
    kind = KV_TYPES[kv_type]
    row = kind.row_elems(hd)
    return view(ptr, KVH * S * row, kind.storage).reshape(KVH, S, row)


def _store_kv(kernel, a):
    T, KVH, hd, S = a["T"], a["KVH"], a["hd"], a["num_slots"]
    slots = view(a["slots"], T, np.int64)
    for src, dst in (("k", "pool_layer_k"), ("v", "pool_layer_v")):
        x = view(a[src], T * KVH * hd).reshape(T, KVH, hd)
        _pool_rows(a[dst], KVH, S, hd, _kv_type(kernel))[:, slots, :] = \
            encode_rows(x, _kv_type(kernel)).transpose(1, 0, 2)


def _attention_rows(a, kv_type: str):
    """Per query row t: (scores [H, L], values [H, L, hd]) over its visible keys (rows decoded to float32)."""
    T, H, KVH, hd, B, S = a["T"], a["H"], a["KVH"], a["hd"], a["block_size"], a["num_slots"]
    q = view(a["q"], T * H * hd).reshape(T, H, hd)
    pool_k = decode_rows(_pool_rows(a["pool_k"], KVH, S, hd, kv_type), hd)
    pool_v = decode_rows(_pool_rows(a["pool_v"], KVH, S, hd, kv_type), hd)
    seq_of, pos_of = view(a["token_seq"], T, np.int32), view(a["token_pos"], T, np.int32)
    tables = view(a["block_tables"], (int(seq_of.max()) + 1) * a["max_blocks"], np.int32)
    heads = np.arange(H) // (H // KVH)
    for t in range(T):
        p, table = int(pos_of[t]), tables[int(seq_of[t]) * a["max_blocks"]:]
        keys = np.arange(max(0, p - a["window"] + 1) if a["window"] else 0, p + 1)
        slots = table[keys // B].astype(np.int64) * B + keys % B
        scores = np.einsum("hd,hld->hl", q[t], pool_k[heads][:, slots, :]) * np.float32(a["scale"])
        yield t, keys, scores, pool_v[heads][:, slots, :]


def _paged_attention(kernel, a):
    T, H, hd = a["T"], a["H"], a["hd"]
    out = view(a["out"], T * H * hd).reshape(T, H, hd)
    for t, _, scores, values in _attention_rows(a, _kv_type(kernel)):
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[t] = np.einsum("hl,hld->hd", probs / probs.sum(axis=-1, keepdims=True), values)


def _paged_attention_split(kernel, a):
    T, H, hd, C = a["T"], a["H"], a["hd"], a["chunk_keys"]
    n_chunks = num_chunks(a["max_blocks"], a["block_size"], C, a["window"])  # the grid the geometry gives
    part_out = view(a["part_out"], T * H * n_chunks * hd).reshape(T, H, n_chunks, hd)
    part_max = view(a["part_max"], T * H * n_chunks).reshape(T, H, n_chunks)
    part_sum = view(a["part_sum"], T * H * n_chunks).reshape(T, H, n_chunks)
    part_out[:], part_max[:], part_sum[:] = 0, -np.inf, 0
    for t, keys, scores, values in _attention_rows(a, _kv_type(kernel)):
        for c in range(n_chunks):
            sel = (keys >= c * C) & (keys < (c + 1) * C)
            if sel.any():
                m = scores[:, sel].max(axis=-1)
                e = np.exp(scores[:, sel] - m[:, None])
                part_max[t, :, c], part_sum[t, :, c] = m, e.sum(axis=-1)
                part_out[t, :, c] = np.einsum("hl,hld->hd", e, values[:, sel])


def _combine(_, a):
    T, H, hd, n = a["T"], a["H"], a["hd"], a["n_chunks"]
    part_out = view(a["part_out"], T * H * n * hd).reshape(T, H, n, hd)
    part_max = view(a["part_max"], T * H * n).reshape(T, H, n)
    part_sum = view(a["part_sum"], T * H * n).reshape(T, H, n)
    m = part_max.max(axis=-1, keepdims=True)
    w = np.where(np.isneginf(part_max), 0, np.exp(part_max - m))
    out = (part_out * w[..., None]).sum(axis=2) / (part_sum * w).sum(axis=-1)[..., None]
    view(a["out"], T * H * hd)[:] = out.reshape(-1)


def _gated(kernel, a):
    T, F = a["T"], a["F"]
    gate_up = view(a["gate_up"], T * 2 * F).reshape(T, 2 * F)
    g, u = gate_up[:, :F], gate_up[:, F:]
    if kernel == "gated_silu_f32":
        act = g / (1 + np.exp(-g))
    else:
        act = 0.5 * g * (1 + np.tanh(np.float32(0.7978845608) * (g + np.float32(0.044715) * g ** 3)))
    view(a["out"], T * F).reshape(T, F)[:] = act * u


def _gather_rows(_, a):
    rows = view(a["rows"], a["n_rows"], np.int64)
    x = view(a["x"], (int(rows.max()) + 1) * a["d"]).reshape(-1, a["d"])
    view(a["out"], a["n_rows"] * a["d"]).reshape(-1, a["d"])[:] = x[rows]


def _pool_blocks(a):
    """The pool as [planes, num_blocks, block_elems] (plane stride num_slots * hd, see the docstring)."""
    hd = a["hd"]
    num_blocks = a["num_slots"] // (a["block_elems"] // hd)
    return view(a["pool"], a["planes"] * a["num_slots"] * hd).reshape(a["planes"], num_blocks, a["block_elems"])


def _copy_kv_blocks(_, a):
    pool = _pool_blocks(a)
    src, dst = view(a["src_blocks"], a["n_pairs"], np.int32), view(a["dst_blocks"], a["n_pairs"], np.int32)
    for s, d in zip(src, dst):
        pool[:, d] = pool[:, s]


def _kv_staging(kernel, a):
    pool, blocks = _pool_blocks(a), view(a["blocks"], a["n"], np.int32)
    staging = view(a["staging"], a["n"] * a["planes"] * a["block_elems"]).reshape(a["n"], a["planes"], -1)
    for i, b in enumerate(blocks):
        if kernel == "gather_kv_blocks_f32":
            staging[i] = pool[:, b]
        else:
            pool[:, b] = staging[i]


def _quant_linear(kernel, a):
    tensor_type = Q[kernel.split("_", 1)[1].upper()]
    T, out, in_, ld = a["T"], a["out"], a["in_"], a["ld_y"]
    elems, nbytes = GGML_QUANT_SIZES[tensor_type]
    raw = view(a["W"], out * in_ // elems * nbytes, np.uint8).reshape(out, -1)
    if tensor_type in (Q.F32, Q.F16):
        w = raw.view(np.float32 if tensor_type == Q.F32 else np.float16).astype(np.float32)
    else:
        w = quants.dequantize(raw, tensor_type).astype(np.float32).reshape(out, in_)
    x = view(a["x"], T * in_).reshape(T, in_)
    y = x @ w.T
    if a["bias"]:
        y += view(a["bias"], out)
    y_all = view(a["y"], (T - 1) * ld + out)
    for t in range(T):
        y_all[t * ld : t * ld + out] = y[t]


KERNELS = {
    "embedding_f32": _embedding, "rms_norm_f32": _rms_norm, "add_rms_norm_f32": _add_rms_norm, "add_f32": _add,
    "split_columns_f32": _split_columns, "rope_neox_f32": _rope, "rope_norm_f32": _rope, "store_kv_f32": _store_kv,
    "paged_attention_f32": _paged_attention, "paged_attention_split_f32": _paged_attention_split,
    "store_kv_f16": _store_kv, "store_kv_int8": _store_kv, "paged_attention_f16": _paged_attention,
    "paged_attention_int8": _paged_attention, "paged_attention_split_f16": _paged_attention_split,
    "paged_attention_split_int8": _paged_attention_split,
    "attention_combine_f32": _combine, "gated_silu_f32": _gated, "gated_gelu_tanh_f32": _gated,
    "gather_rows_f32": _gather_rows, "copy_kv_blocks_f32": _copy_kv_blocks, "gather_kv_blocks_f32": _kv_staging,
    "scatter_kv_blocks_f32": _kv_staging, "matvec": _quant_linear, "gemm": _quant_linear,
}
