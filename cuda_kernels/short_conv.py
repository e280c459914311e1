"""Launch geometry for short_conv.cu: one thread per (sequence, channel)."""
from __future__ import annotations

from cuda_kernels.launch import flat_geometry, unknown_kernel


def geometry(kernel: str, **ints: int):
    """(grid, block, dynamic shared bytes) from the kernel's int arguments (names as in its signature)."""
    if kernel != "short_conv_f32":
        raise unknown_kernel("short_conv.cu", kernel)
    return flat_geometry(ints["n_seqs"] * ints["d"])
