"""Launch geometry for rope.cu: one thread per rotated pair."""
from __future__ import annotations

from cuda_kernels.launch import flat_geometry, unknown_kernel

KERNELS = ("rope_neox_f32", "rope_norm_f32")


def geometry(kernel: str, **ints: int):
    """(grid, block, dynamic shared bytes) from T, H and rope_dims (even, at most hd)."""
    if kernel not in KERNELS:
        raise unknown_kernel("rope.cu", kernel)
    if ints["rope_dims"] % 2 or not 0 < ints["rope_dims"] <= ints["hd"]:
        raise ValueError(f"rope_dims {ints['rope_dims']} must be even and in (0, hd={ints['hd']}]")
    return flat_geometry(ints["T"] * ints["H"] * (ints["rope_dims"] // 2))
