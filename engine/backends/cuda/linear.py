"""Linear layers on quantised weights: GGUF blocks on the device, one matvec/gemm launch per part.

A fused matrix (QKV, gate|up) whose parts share a type arrives as one part (the loader concatenates them);
parts of different types become several launches, each writing its own column range of y:

    y [T, out]   | part 0: rows 0..o0 (q4_k) | part 1: rows o0..o0+o1 (q6_k) | ...
    launch i:    y + col_start_i floats, ld_y = out, out = o_i, bias + col_start_i

Per-type facts (block size, row bytes, kernel suffix, which types have kernels, when gemm beats matvec) come
from `cuda_kernels.quant_types`, imported on first use.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from engine.quant_weights import LinearPart

# The contract's matvec range (docs/CUDA_KERNELS.md: "for small T (1..8, decode)"), used when quant_types
# exports no threshold of its own.
DEFAULT_MATVEC_MAX_T = 8


def quant_types():
    from cuda_kernels import quant_types as qt  # needs only the kernels package, not a GPU

    return qt


def kernel_suffix(tensor_type: GGMLQuantizationType) -> str:
    """`q4_k` for Q4_K: the `<q>` of matvec_<q> / gemm_<q>."""
    qt = quant_types()
    if hasattr(qt, "kernel_suffix"):
        return qt.kernel_suffix(tensor_type)
    return GGMLQuantizationType(tensor_type).name.lower()


def matvec_max_t() -> int:
    return int(getattr(quant_types(), "MATVEC_MAX_T", DEFAULT_MATVEC_MAX_T))


def supports(tensor_type: GGMLQuantizationType) -> bool:
    return bool(quant_types().supported(GGMLQuantizationType(tensor_type)))


@dataclass(frozen=True)
class Segment:
    """One part of a linear on the device: rows [col_start, col_start + out_rows) of the output."""

    suffix: str
    weight: object  # DeviceArray of uint8 [out_rows, row_bytes]
    col_start: int
    out_rows: int


class QuantLinear:
    """A weight matrix [out, in] held in GGUF blocks on the device (never dequantised to memory)."""

    def __init__(self, segments: list[Segment], out_dim: int, in_dim: int):
        self.segments = segments
        self.out_dim, self.in_dim = out_dim, in_dim
        self.shape = (out_dim, in_dim)

    @property
    def nbytes(self) -> int:
        return sum(s.weight.nbytes for s in self.segments)


def upload_parts(backend, parts: list[LinearPart]) -> QuantLinear:
    """Copy each part's raw rows to the device; the parts stack along the output dimension."""
    in_dim = parts[0].in_dim
    qt = quant_types()
    segments, col = [], 0
    for part in parts:
        assert part.in_dim == in_dim, f"{part.name}: in_dim {part.in_dim} != {in_dim} of the first part"
        rows = np.ascontiguousarray(part.rows)
        expected = qt.row_bytes(GGMLQuantizationType(part.tensor_type), in_dim)
        assert rows.shape == (part.out_dim, expected), \
            f"{part.name}: raw rows {rows.shape}, expected ({part.out_dim}, {expected}) for {in_dim} inputs"
        weight = backend.upload_bytes(rows, f"weight {part.name}")
        segments.append(Segment(kernel_suffix(part.tensor_type), weight, col, part.out_dim))
        col += part.out_dim
    return QuantLinear(segments, col, in_dim)


def float_linear(backend, weight: np.ndarray, name: str = "linear") -> QuantLinear:
    """A float32 [out, in] matrix as an F32 'quantised' weight (exact: the reference path and the tests)."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    part = LinearPart(GGMLQuantizationType.F32, weight.view(np.uint8), weight.shape[0], weight.shape[1], name)
    return upload_parts(backend, [part])


def launch_linear(backend, x, w: QuantLinear, bias=None):
    """y [T, out] = x [T, in] @ W.T (+ bias): matvec for few rows, gemm for many."""
    T = x.shape[0]
    assert x.shape == (T, w.in_dim), f"linear: x {x.shape} does not match weight {w.shape}"
    y = backend.empty((T, w.out_dim))
    kind = "matvec" if T <= matvec_max_t() else "gemm"
    for seg in w.segments:
        backend.launch(f"{kind}_{seg.suffix}", y=y.ptr + 4 * seg.col_start, W=seg.weight, x=x,
                       bias=None if bias is None else bias.ptr + 4 * seg.col_start,
                       T=T, out=seg.out_rows, in_=w.in_dim, ld_y=w.out_dim)
    return y
