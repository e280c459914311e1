"""Numpy versions of the kernels of docs/CUDA_KERNELS.md, reading and writing memory through raw addresses.

Used by tests/support/fake_cuda.py. Each takes (kernel name, {argument: value}) with pointers as int addresses.
"""
from __future__ import annotations

import ctypes
import types

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from cuda_kernels.attention import num_chunks
from engine.kv import KV_TYPES
from engine.kv_quant import decode_rows, encode_rows
from tests.support.fake_cuda_vmm import check_access


def view(ptr, count: int, dtype=np.float32) -> np.ndarray:
    """count elements of dtype at a real address, as a writable numpy array; a range that touches an unmapped
    part of a reserved address range fails here, as the GPU faults (tests/support/fake_cuda_vmm.py)."""
    nbytes = int(count) * np.dtype(dtype).itemsize
    bad = check_access(int(ptr), nbytes)
    assert not bad, f"a kernel touched unmapped device memory: {bad}"
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


def _mul(_, a):
    view(a["out"], a["n"])[:] = view(a["a"], a["n"]) * view(a["b"], a["n"])


def _short_conv(_, a):
    """short_conv_f32 (short_conv.cu) through engine/short_conv.numpy_short_conv on a stand-in pool."""
    from engine.short_conv import ConvStatePool, numpy_short_conv

    n, d, L = a["n_seqs"], a["d"], a["L"]
    start, length = view(a["seq_start"], n, np.int32), view(a["seq_len"], n, np.int32)
    pos, slot = view(a["start_pos"], n, np.int32), view(a["state_slot"], n, np.int32)
    T = int((start + length).max())
    slots = int(slot.max()) + 1
    pool = ConvStatePool((0,), L, d, num_slots=slots)
    states = view(a["states"], slots * (L - 1) * d).reshape(slots, L - 1, d)
    pool.conv[0] = states  # in place, as the kernel
    seqs = [types.SimpleNamespace(query_start=int(s), query_len=int(q), start_pos=int(p), state_slot=int(k),
                                  context_len=int(p + q)) for s, q, p, k in zip(start, length, pos, slot)]
    out = numpy_short_conv(view(a["u"], T * d).reshape(T, d), view(a["w"], d * L).reshape(d, L), pool, 0,
                           types.SimpleNamespace(seqs=seqs))
    rows = view(a["out"], T * d).reshape(T, d)
    for s in seqs:
        rows[s.query_start : s.query_start + s.query_len] = out[s.query_start : s.query_start + s.query_len]


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


def _pool_rows(ptr, KVH: int, S: int, hd: int, kv_type: str, seg_rows: int, n_seg: int) -> np.ndarray:
    """One layer's stored rows [n_seg, KVH, S, row] of a --kv-type (engine/kv_quant.py): segment s starts
    s * seg_rows rows after segment 0 (kv_blocks.cu; a fixed pool is one segment)."""
    kind = KV_TYPES[kv_type]
    row = kind.row_elems(hd)
    item = np.dtype(kind.storage).itemsize
    span = ((n_seg - 1) * seg_rows + KVH * S) * row
    flat = view(ptr, span, kind.storage)
    return np.lib.stride_tricks.as_strided(flat, (n_seg, KVH, S, row),
                                           (seg_rows * row * item, S * row * item, row * item, item))


def _store_kv(kernel, a):
    T, KVH, hd, S = a["T"], a["KVH"], a["hd"], a["num_slots"]
    slots = view(a["slots"], T, np.int64)
    live = slots >= 0  # a negative slot is a padding row: skipped
    seg, local = slots[live] // S, slots[live] % S
    for src, dst in (("k", "pool_layer_k"), ("v", "pool_layer_v")):
        x = view(a[src], T * KVH * hd).reshape(T, KVH, hd)[live]
        pool = _pool_rows(a[dst], KVH, S, hd, _kv_type(kernel), a["seg_rows"], int(seg.max(initial=0)) + 1)
        pool[seg, :, local] = encode_rows(x, _kv_type(kernel))


def _attention_rows(a, kv_type: str):
    """Per query row t: (scores [H, L], values [H, L, hd]) over its visible keys (rows decoded to float32)."""
    T, H, KVH, hd, B, S = a["T"], a["H"], a["KVH"], a["hd"], a["block_size"], a["num_slots"]
    q = view(a["q"], T * H * hd).reshape(T, H, hd)
    seq_of, pos_of = view(a["token_seq"], T, np.int32), view(a["token_pos"], T, np.int32)
    tables = view(a["block_tables"], (int(seq_of.max()) + 1) * a["max_blocks"], np.int32)
    heads = np.arange(H) // (H // KVH)
    for t in range(T):
        p, table = int(pos_of[t]), tables[int(seq_of[t]) * a["max_blocks"]:]
        keys = np.arange(max(0, p - a["window"] + 1) if a["window"] else 0, p + 1)
        slots = table[keys // B].astype(np.int64) * B + keys % B
        n_seg = int(slots.max()) // S + 1
        k, v = (decode_rows(_pool_rows(a[name], KVH, S, hd, kv_type, a["seg_rows"], n_seg)[slots // S, :, slots % S],
                            hd).transpose(1, 0, 2)[heads] for name in ("pool_k", "pool_v"))  # [H, L, hd]
        scores = np.einsum("hd,hld->hl", q[t], k) * np.float32(a["scale"])
        yield t, keys, scores, v


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


def _pool_blocks(a, blocks) -> tuple[np.ndarray, int]:
    """(The pool as [n_seg, planes, seg_blocks, block_elems], seg_blocks): segments of num_slots slots, each
    every plane's run of them (kv_blocks.cu); n_seg covers the highest of `blocks`."""
    hd = a["hd"]
    seg_blocks = a["num_slots"] // (a["block_elems"] // hd)
    n_seg = int(np.max(blocks)) // seg_blocks + 1
    words = n_seg * a["planes"] * a["num_slots"] * hd
    return view(a["pool"], words).reshape(n_seg, a["planes"], seg_blocks, a["block_elems"]), seg_blocks


def _copy_kv_blocks(_, a):
    src, dst = view(a["src_blocks"], a["n_pairs"], np.int32), view(a["dst_blocks"], a["n_pairs"], np.int32)
    pool, sb = _pool_blocks(a, np.concatenate([src, dst]))
    for s, d in zip(src, dst):
        pool[d // sb, :, d % sb] = pool[s // sb, :, s % sb]


def _kv_staging(kernel, a):
    blocks = view(a["blocks"], a["n"], np.int32)
    pool, sb = _pool_blocks(a, blocks)
    staging = view(a["staging"], a["n"] * a["planes"] * a["block_elems"]).reshape(a["n"], a["planes"], -1)
    for i, b in enumerate(blocks):
        if kernel == "gather_kv_blocks_f32":
            staging[i] = pool[b // sb, :, b % sb]
        else:
            pool[b // sb, :, b % sb] = staging[i]


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
    "mul_f32": _mul, "short_conv_f32": _short_conv,
    "split_columns_f32": _split_columns, "rope_neox_f32": _rope, "rope_norm_f32": _rope, "store_kv_f32": _store_kv,
    "paged_attention_f32": _paged_attention, "paged_attention_split_f32": _paged_attention_split,
    "store_kv_f16": _store_kv, "store_kv_int8": _store_kv, "paged_attention_f16": _paged_attention,
    "paged_attention_int8": _paged_attention, "paged_attention_split_f16": _paged_attention_split,
    "paged_attention_split_int8": _paged_attention_split,
    "attention_combine_f32": _combine, "gated_silu_f32": _gated, "gated_gelu_tanh_f32": _gated,
    "gather_rows_f32": _gather_rows, "copy_kv_blocks_f32": _copy_kv_blocks, "gather_kv_blocks_f32": _kv_staging,
    "scatter_kv_blocks_f32": _kv_staging, "matvec": _quant_linear, "gemm": _quant_linear,
}
