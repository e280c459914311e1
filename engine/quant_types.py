"""The GGUF weight types strata computes on, in one table: which kernels each has on the CPU
(engine/backends/cpu/) and on CUDA (cuda_kernels/). Block geometry is gguf's (`gguf.GGML_QUANT_SIZES`:
weights and bytes per block), never restated; every other list of types is derived from this table.

Adding a type: a row here, its decoder in engine/backends/cpu/gguf_dequant.py (an id constant named as the
type; its repack in int8_repack.py where `int8_repack`), its matvec_<q> / gemm_<q> in cuda_kernels/ where `cuda`.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True)
class QuantType:
    """One GGUF type and the kernels it has."""

    gguf_type: Q
    cpu: bool = True  # a CPU decoder, named as the type (cpu/gguf_dequant.py's Q4_K, ...)
    int8_repack: bool = False  # repacked for the integer-activation products (cpu/int8_repack.py)
    half_scales: bool = False  # its repacked scales fit float16 exactly (the k-quants' d_super * sc do not)
    cuda: bool = False  # matvec_<q> / gemm_<q> exist (cuda_kernels/matvec_quant.cu, gemm_quant.cu)

    @property
    def name(self) -> str:
        return self.gguf_type.name  # "Q4_K"

    @property
    def suffix(self) -> str:
        return self.name.lower()  # the <q> of the CUDA kernel names

    @property
    def block_elems(self) -> int:
        return GGML_QUANT_SIZES[self.gguf_type][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.gguf_type][1]


QUANT_TYPES: dict[Q, QuantType] = {t.gguf_type: t for t in (
    QuantType(Q.F32, cuda=True),
    QuantType(Q.F16, cuda=True),
    QuantType(Q.BF16, cuda=True),
    QuantType(Q.Q4_0, int8_repack=True, half_scales=True, cuda=True),
    QuantType(Q.Q4_1, int8_repack=True, half_scales=True, cuda=True),
    QuantType(Q.Q5_0, int8_repack=True, half_scales=True, cuda=True),
    QuantType(Q.Q5_1, int8_repack=True, half_scales=True),
    QuantType(Q.Q8_0, int8_repack=True, half_scales=True, cuda=True),
    QuantType(Q.Q4_K, int8_repack=True, cuda=True),
    QuantType(Q.Q5_K, int8_repack=True),
    QuantType(Q.Q6_K, int8_repack=True, cuda=True),
    QuantType(Q.MXFP4, cuda=True),
)}
INT8_TYPES = tuple(t.gguf_type for t in QUANT_TYPES.values() if t.int8_repack)
HALF_SCALE_TYPES = tuple(t.gguf_type for t in QUANT_TYPES.values() if t.half_scales)
CPU_TYPES = tuple(t.gguf_type for t in QUANT_TYPES.values() if t.cpu)
CUDA_TYPES = tuple(t for t in QUANT_TYPES.values() if t.cuda)
