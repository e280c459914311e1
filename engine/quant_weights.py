"""Linear weights as raw GGUF rows, for backends that compute on quantised blocks (`upload_linear_quantized`).

A GGUF matrix [out, in] is stored row by row, each row `in / block_elems` whole blocks, so selecting or
reordering rows works on the raw bytes exactly as on the dequantised floats. That is what lets the llama
Q/K un-permutation (a row permutation) be applied to the blocks, and fused matrices be built from parts:

    QKV  = [ Q rows (un-permuted) | K rows (un-permuted) | V rows ]   one part per type run
    gate_up = [ gate rows | up rows ]

Adjacent parts of one type are concatenated into one (one launch); a type the backend has no kernel for
is dequantised and re-encoded as the backend's `fallback_quant_type` (F16 on the GPU, F32 on the CPU),
with a warning naming the tensor.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType

from engine.gguf_file import GGUFFile
from engine.units import MIB

log = logging.getLogger("strata.weights")


class LinearPart(NamedTuple):
    """Rows [out_dim, row_bytes] of one GGUF type; stacked parts form a fused matrix's output rows."""

    tensor_type: GGMLQuantizationType
    rows: np.ndarray  # uint8 [out_dim, row_bytes]
    out_dim: int
    in_dim: int
    name: str = ""


def unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K interleave on any [out, X] array (floats or raw block bytes): per head, rows
    (pair, 2) -> (2, pair). The same permutation as weights.unpermute_qk, which it generalises."""
    out_dim = rows.shape[0]
    head_dim = out_dim // n_heads
    tail = rows.shape[1:]
    return rows.reshape(n_heads, head_dim // 2, 2, *tail).swapaxes(1, 2).reshape(out_dim, *tail)


_FALLBACK_DTYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32}


def raw_part(gguf: GGUFFile, name: str, supported: Callable[[GGMLQuantizationType], bool],
             unpermute_heads: int = 0, fallback: GGMLQuantizationType = GGMLQuantizationType.F16) -> LinearPart:
    """One tensor as a LinearPart: its raw rows if `supported(type)`, else `fallback` (F16 or F32) rows of
    its dequantised values."""
    out_dim, in_dim = gguf.tensor_shape(name)
    tensor_type, rows = gguf.tensor_raw(name)
    if not supported(tensor_type):
        dtype = _FALLBACK_DTYPES[fallback]
        log.warning("tensor %s: no kernel for type %s on this backend, uploading it dequantised as %s (%d MiB)",
                    name, tensor_type.name, fallback.name, out_dim * in_dim * np.dtype(dtype).itemsize // MIB)
        tensor_type = fallback
        rows = gguf.tensor(name).astype(dtype).view(np.uint8)
    if unpermute_heads:
        rows = unpermute_rows(rows, unpermute_heads)
    return LinearPart(tensor_type, rows, out_dim, in_dim, name)


def merge_parts(parts: list[LinearPart]) -> list[LinearPart]:
    """Concatenate runs of adjacent parts with the same type (one launch instead of several)."""
    merged: list[LinearPart] = []
    for part in parts:
        prev = merged[-1] if merged else None
        if prev is not None and prev.tensor_type == part.tensor_type:
            assert prev.in_dim == part.in_dim, f"{prev.name} and {part.name} have different input widths"
            rows = np.concatenate([prev.rows, part.rows], axis=0)
            merged[-1] = LinearPart(prev.tensor_type, rows, prev.out_dim + part.out_dim, prev.in_dim,
                                    f"{prev.name}+{part.name}")
        else:
            merged.append(part)
    return merged


class QuantizedLinearLoader:
    """Builds the fused linears of engine/weights.py from raw rows, for a backend with quantised kernels."""

    def __init__(self, gguf: GGUFFile, backend):
        self.gguf, self.backend = gguf, backend
        self.supported = backend.supports_quant_type
        self.fallback = backend.capabilities.fallback_quant_type

    def linear(self, names: list[str], unpermute_heads: list[int] | None = None):
        """Upload the row-stack of tensors `names` (each optionally Q/K un-permuted) as one linear."""
        heads = unpermute_heads or [0] * len(names)
        parts = [raw_part(self.gguf, n, self.supported, h, self.fallback) for n, h in zip(names, heads)]
        return self.backend.upload_linear_quantized(merge_parts(parts))

    def embedding(self, name: str):
        """The token table `name` as one raw part (`upload_embedding_quantized`), never dequantised whole."""
        return self.backend.upload_embedding_quantized(raw_part(self.gguf, name, self.supported,
                                                                fallback=self.fallback))
