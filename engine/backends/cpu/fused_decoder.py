"""The fused decode step of the quantised numpy backend: a whole decode batch in one numba call.

A decode step on the unfused path (engine/model.py) makes ~15 backend calls per layer, each a Python
dispatch and several a wake-up of numba's sleeping thread pool; on SmolLM2 (30 layers) that was most of
a token. `FusedDecoder.forward` runs the same math as one compiled call (fused_step.decode_step: every
layer and the output head in one parallel region) after the embedding lookup.

It takes a step only when every sequence brings one new token, there are at most KERNEL_MAX_ROWS of them
and the K/V pool is float32 or float16; anything else (prefill chunks, int8 K/V) returns None and the caller
runs the unfused path, which stays the reference. Models it cannot run at all (MoE, lfm2's short
convolutions, gpt-oss's output bias and sinks, a linear of more than two GGUF types) are refused once
at build time with the reason, logged by the backend.
"""
from __future__ import annotations

import numba
import numpy as np
from numba.typed import List

from engine.backends.cpu.fused_layer import GELU_TANH, SILU
from engine.backends.cpu.fused_step import decode_step
from engine.backends.cpu.gguf_dequant import f16_table
from engine.backends.cpu.gguf_row_kernels import _LANES, call_kernel
from engine.backends.cpu.int8_repack import HALF_SCALE_TYPES, INT8_TYPES, empty_part, repack
from engine.backends.cpu.quant_linear import (KERNEL_KINDS, KERNEL_MAX_ROWS, QuantLinear, mapping_root,
                                             release_mappings)
from engine.batch import BatchMeta

_F32 = np.float32
_TABLE = f16_table()
_NONE = np.zeros(0, np.float32)  # an absent optional weight
_NO_PART = (0, np.zeros((0, 1), np.uint8))  # the absent second part of a one-type linear
_NO_PART[1].flags.writeable = False
_ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH}
_GGUF_TYPE = {k: t for t, k in KERNEL_KINDS.items()}
_POOL_VIEWS = {"f32": np.float32, "f16": np.uint16}  # K/V types the step reads and writes, as the dtype it sees
# Activation kinds -> the integer range the decode products quantise them to (0: not quantised). int16
# costs the same as int8 in int8_matvec (its products are int16 either way) and its rounding is 256x
# finer: on gemma3 int8 moved logits by up to 0.37 and changed greedy ids after 16 tokens, int16 by ~1e-3.
ACT_QMAX = {"f32": _F32(0.0), "int8": _F32(127.0), "int16": _F32(32767.0)}
# Every step the fused path takes runs the integer kernels (simd_dot: up to 4 tokens a row call). The
# float path has only rows decoded from the repacked form once the raw rows are let go: a 4-token SmolLM2
# step took 80 ms on those against 47 on the integer loops of the time (session 6, Intel); the integer
# kernels now take 26 (session 7, AMD).
INT_MAX_TOKENS = KERNEL_MAX_ROWS


def fused_refusal(model) -> str | None:
    """Why `model` cannot run fused (None: it can)."""
    c, w = model.config, model.weights
    if c.n_experts or c.is_hybrid or c.has_attn_out_bias or c.has_attn_sinks:
        return f"{c.arch} has experts, recurrent layers or attention sinks"
    if c.activation not in _ACTIVATIONS:
        return f"activation {c.activation}"
    linears = [w.output] + [m for lw in w.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
    if not all(isinstance(m, QuantLinear) and len(m.parts) <= 2 for m in linears):
        return "a linear is not raw rows of at most two GGUF types"
    if not isinstance(w.embedding, QuantLinear):
        return "the embedding table is not raw rows"
    return None


def _parts(linear: QuantLinear) -> tuple:
    """The float-activation form of a linear: raw rows (kind0, rows0, kind1, rows1), or once its rows were
    let go for a repacked copy (QuantLinear.adopt_repacked) the two repacked parts and a 0 (float32 rows
    decoded from them, cpu/repacked_rows.py)."""
    if linear.repacked is not None:
        part0, part1 = _adopted(linear)
        return part0, part1, 0
    (k0, r0, _), (k1, r1, _) = (linear.parts + [(*_NO_PART, 0)])[:2]
    return k0, r0, k1, r1


def _adopted(linear: QuantLinear) -> tuple:
    parts = [tuple(part) for part, _ in linear.repacked]
    empty = tuple(empty_part(parts[0][3].dtype == np.uint16))
    return (parts + [empty])[0], (parts + [empty])[1]


def int8_refusal(model) -> str | None:
    """Why `model`'s linears cannot take int8 activations (None: they can); the float kernels run then."""
    linears = [model.weights.output] + [m for lw in model.weights.layers
                                        for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
    kinds = {KERNEL_KINDS[t] for t in INT8_TYPES}
    bad = {k for m in linears for k, _, _ in m.parts if k not in kinds}
    return f"weight kinds {sorted(bad)} have no int8 kernel" if bad else None


def _int8_parts(linear: QuantLinear, half_scales: bool) -> tuple:
    """The linear's parts repacked (int8_repack) as the (part0, part1) pair the step's products take."""
    parts = [tuple(repack(_GGUF_TYPE[k], rows, linear.in_dim, half_scales)) for k, rows, _ in linear.parts]
    empty = tuple(empty_part(half_scales))
    return (parts + [empty])[0], (parts + [empty])[1]


def _repack_and_adopt(layers: list[QuantLinear], head: QuantLinear, act_qmax: float = 32767.0
                      ) -> tuple[list[tuple], int]:
    """Every linear repacked and adopting its repacked copy (QuantLinear.adopt_repacked), one at a time so
    that each one's raw copy is freed before the next is repacked (peak RSS: one linear's two forms, not
    the model's). The layers' linears all with float16 scales when every part allows it exactly (2-4 bytes
    a 32-weight group fewer to stream: 24 -> 20 for q4_1, 36 -> 34 for q8_0), else all float32 (the step's
    typed List of layers holds one array type); the head, in a List of its own, decides for itself (gemma3's
    Q8_0 head beside Q4_K / Q6_K layers: 190 -> 179 MB a token). Returns the (part0, part1) pairs, the
    head's last, and the bytes of file mapping handed back: the whole file once up front (the loader has read
    every tensor; repacking re-reads a linear's pages from the page cache), and each linear's pages again
    after its repack."""
    linears = layers + [head]
    if all(m.repacked is not None for m in linears):  # an earlier decoder of this model repacked them
        return [_adopted(m) for m in linears], 0
    half_layers, half_head = (all(_GGUF_TYPE[k] in HALF_SCALE_TYPES for m in group for k, _, _ in m.parts)
                              for group in (layers, [head]))
    mappings = [root for m in linears for _, rows, _ in m.parts if (root := mapping_root(rows)) is not None]
    released = release_mappings(mappings)
    pairs = []
    for linear in linears:
        if linear.repacked is None:
            part0, part1 = _int8_parts(linear, half_head if linear is head else half_layers)
            release_mappings(linear.adopt_repacked([part0, part1][: len(linear.parts)], act_qmax))
        pairs.append(_adopted(linear))
    return pairs, released


def _opt(array) -> np.ndarray:
    return _NONE if array is None else array


class FusedDecoder:
    """The arguments of fused_step.decode_step, gathered once from a model's weights. Immutable.

    activations "int16" / "int8": steps of up to INT_MAX_TOKENS tokens quantise the activations per
    32-value block to integers (ACT_QMAX) and take integer dot products on weights repacked at construction
    (cpu/int8_matvec.py; about the quantised bytes, cpu/int8_repack.py), which then replace the raw rows in
    the model's QuantLinears; larger steps use float32 activations on rows decoded from them
    (cpu/repacked_rows.py). "f32": float activations on the raw rows (cpu/fused_matvec.py). The caller
    checks int8_refusal before asking for an integer kind."""

    workers: int | None = None  # the step's region workers (None: the kernel thread count); tests vary it

    def __init__(self, model, activations: str = "f32"):
        c, w = model.config, model.weights
        self.config = c  # no reference to the model itself: the backend caches decoders by weak model keys
        self.embedding = w.embedding
        self.output_norm = np.ascontiguousarray(w.output_norm, np.float32)
        self.activations, self.qmax = activations, ACT_QMAX[activations]
        self.layers = List()
        for lw in w.layers:
            self.layers.append(tuple(np.ascontiguousarray(_opt(a), np.float32) for a in (
                lw.attn_norm, lw.bqkv, lw.q_norm, lw.k_norm, lw.post_attn_norm, lw.ffn_norm, lw.post_ffn_norm)))
        self.windows = np.array([c.sliding_window if s else 0 for s in c.layer_is_sliding], np.int64)
        self.local_rope = np.array(c.layer_is_sliding, np.bool_)
        self.rope_tables = tuple(np.ascontiguousarray(a, np.float32) for a in (*w.rope_global, *w.rope_local))
        # (wqkv, wo, w_gate_up, w_down) per layer, and the head. Integer activations: the weights repacked,
        # and the repacked copy replaces the raw rows everywhere (float-activation steps, prefill, the
        # embedding when tied to the head), so the file's rows stop taking memory.
        self.released_bytes = 0
        if activations != "f32":
            linears = [m for lw in w.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
            parts, self.released_bytes = _repack_and_adopt(linears, w.output, float(self.qmax))
            self.linears = {"int": _typed([tuple(parts[4 * i : 4 * i + 4]) for i in range(len(w.layers))])}
            self.output = {"int": _typed([parts[-1]])}
        else:
            self.linears, self.output = {}, {}
        self.linears["f32"] = _typed([tuple(_parts(m) for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))
                                      for lw in w.layers])
        self.output["f32"] = _typed([_parts(w.output)])
        self.eps, self.scale = _F32(c.rms_eps), _F32(c.attn_scale)
        self.act = _ACTIVATIONS[c.activation]

    @staticmethod
    def accepts(batch: BatchMeta, kv_pool) -> bool:
        """A decode step this path runs: one new token per sequence, few sequences, a float32 pool."""
        return (batch.num_tokens <= KERNEL_MAX_ROWS and batch.num_tokens == len(batch.seqs)
                and kv_pool.layout.kv_type in _POOL_VIEWS)

    def forward(self, batch: BatchMeta, kv_pool) -> np.ndarray:
        """Logits [len(batch.logit_rows), vocab] of a step `accepts` took; writes each layer's K/V."""
        return call_kernel(self._forward, batch, kv_pool)

    def _forward(self, batch: BatchMeta, kv_pool) -> np.ndarray:
        c = self.config
        kind = "int" if self.activations != "f32" and batch.num_tokens <= INT_MAX_TOKENS else "f32"
        view = _POOL_VIEWS[kv_pool.layout.kv_type]  # numba has no float16: a float16 pool goes in as its bits
        k_pool, v_pool = kv_pool.k.view(view), kv_pool.v.view(view)
        x = self.embedding.gather(batch.token_ids)  # [T, d], as QuantizedNumpyBackend.embedding
        if c.embed_scale != 1.0:
            x *= _F32(c.embed_scale)
        return decode_step(x, self.layers, self.linears[kind], self.windows, self.local_rope, self.rope_tables,
                           self.output[kind], self.output_norm, np.asarray(batch.logit_rows, np.int64), k_pool,
                           v_pool, batch.positions, batch.slot_mapping, _block_tables(batch), batch.block_size,
                           c.rope_dims, c.n_heads, c.n_kv_heads, self.scale, self.eps, self.act, _TABLE, _LANES,
                           self.qmax, self.workers or numba.get_num_threads())


def _typed(items: list) -> List:
    """A numba typed List (unboxed in O(1) per call, where a tuple of tuples is checked element by element)."""
    out = List()
    for item in items:
        out.append(item)
    return out


def _block_tables(batch: BatchMeta) -> np.ndarray:
    """[T, max blocks] int64: row t is sequence t's block table, padded with 0 (never read past its context)."""
    width = max(-(-s.context_len // batch.block_size) for s in batch.seqs)
    tables = np.zeros((len(batch.seqs), width), np.int64)
    for t, s in enumerate(batch.seqs):
        n = -(-s.context_len // batch.block_size)
        tables[t, :n] = s.block_table[:n]
    return tables
