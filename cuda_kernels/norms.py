"""Launch geometry for norms.cu: one block per row."""
from __future__ import annotations

from cuda_kernels.launch import row_block_threads, unknown_kernel

KERNELS = ("rms_norm_f32", "add_rms_norm_f32")


def geometry(kernel: str, **ints: int):
    """(grid, block, dynamic shared bytes) for rms_norm_f32 / add_rms_norm_f32, from `rows` and `n`."""
    if kernel not in KERNELS:
        raise unknown_kernel("norms.cu", kernel)
    return (max(1, ints["rows"]), 1, 1), (row_block_threads(ints["n"]), 1, 1), 0
