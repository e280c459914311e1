"""GGUF weight types the quantised CUDA kernels read (`matvec_<q>` / `gemm_<q>` in matvec_quant.cu and
gemm_quant.cu), their block geometry, and the rule that picks matvec or gemm for a product.

Types are named as GGUF names them (`GGMLQuantizationType.Q4_K.name == "Q4_K"`); an enum member works too.
Weights stay in their GGUF blocks on the device: row r of an [out, in] matrix is `row_bytes(type, in)` bytes
at `W + r * row_bytes`, exactly as in the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.quant_types import CUDA_TYPES


@dataclass(frozen=True)
class QuantType:
    """One GGUF type as the kernels see it: `block_elems` weights are stored in `block_bytes` bytes."""

    name: str           # GGUF type name, e.g. "Q4_K"
    block_elems: int    # weights per block (1 for the plain float types)
    block_bytes: int    # bytes per block
    suffix: str         # kernel name suffix: matvec_<suffix>, gemm_<suffix>


# The types with kernels: engine/quant_types.py's `cuda` rows, their geometry gguf's.
QUANT_TYPES: dict[str, QuantType] = {
    t.name: QuantType(t.name, t.block_elems, t.block_bytes, t.suffix) for t in CUDA_TYPES}

# Both kernels decode 8 consecutive weights at a time, so `in` must also be a multiple of 8 for the float types.
KERNEL_CHUNK_ELEMS = 8

# matvec_<q> keeps one accumulator per token row in registers (up to 8); beyond that the tensor-core gemm,
# which reads each weight tile once per 64 token rows, wins.
MATVEC_MAX_T = 8


def _name(qtype: Any) -> str:
    return str(getattr(qtype, "name", qtype)).upper()


def supported(qtype: Any) -> bool:
    """Whether matvec_<q> and gemm_<q> exist for this GGUF type (name or GGMLQuantizationType)."""
    return _name(qtype) in QUANT_TYPES


def quant_type(qtype: Any) -> QuantType:
    """The QuantType for a GGUF type name or enum member; ValueError for a type without kernels."""
    name = _name(qtype)
    if name not in QUANT_TYPES:
        raise ValueError(f"no CUDA matvec/gemm kernels for GGUF type {name}; supported: {', '.join(QUANT_TYPES)}")
    return QUANT_TYPES[name]


def check_in_dim(qtype: Any, in_dim: int) -> None:
    """ValueError unless rows of `in_dim` weights of this type are whole blocks and whole 8-weight chunks."""
    qt = quant_type(qtype)
    unit = max(qt.block_elems, KERNEL_CHUNK_ELEMS)
    if in_dim <= 0 or in_dim % unit:
        raise ValueError(f"{qt.name} rows need an input dimension that is a positive multiple of {unit}, "
                         f"got {in_dim}")


def row_bytes(qtype: Any, in_dim: int) -> int:
    """Bytes of one weight row of `in_dim` elements, as stored in the GGUF file."""
    check_in_dim(qtype, in_dim)
    qt = quant_type(qtype)
    return in_dim // qt.block_elems * qt.block_bytes


def use_gemm(T: int) -> bool:
    """The backend's rule: matvec for 1..MATVEC_MAX_T token rows (decode), tensor-core gemm beyond (prefill)."""
    return T > MATVEC_MAX_T


def kernel_name(qtype: Any, T: int) -> str:
    """The kernel for a product of T token rows with a weight of this type, e.g. "matvec_q4_k"."""
    return f"{'gemm' if use_gemm(T) else 'matvec'}_{quant_type(qtype).suffix}"
