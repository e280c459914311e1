"""Launch geometry for activations.cu: one thread per output element of [T, F]."""
from __future__ import annotations

from cuda_kernels.launch import flat_geometry, unknown_kernel

KERNELS = ("gated_silu_f32", "gated_gelu_tanh_f32")


def geometry(kernel: str, **ints: int):
    """(grid, block, dynamic shared bytes) from T and F."""
    if kernel not in KERNELS:
        raise unknown_kernel("activations.cu", kernel)
    return flat_geometry(ints["T"] * ints["F"])
