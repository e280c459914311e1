"""Launch geometry of matvec_quant.cu (`matvec_<q>`, decode: T = 1..8 token rows).

4 warps per CTA, 4 consecutive output rows per warp (16 rows a CTA); no dynamic shared memory (x is read
through the caches, every warp reads the same rows of it).
"""
from __future__ import annotations

from cuda_kernels.quant_types import MATVEC_MAX_T

MATVEC_WARPS_PER_CTA = 4   # must match matvec_quant.cu
MATVEC_ROWS_PER_WARP = 4
MATVEC_ROWS_PER_CTA = MATVEC_WARPS_PER_CTA * MATVEC_ROWS_PER_WARP
WARP_SIZE = 32

Dim3 = tuple[int, int, int]


def geometry(kernel: str, *, T: int, out: int, in_: int, ld_y: int) -> tuple[Dim3, Dim3, int]:
    """(grid, block, dynamic shared bytes) for matvec_<q>(y, W, x, bias, T, out, in, ld_y).

    ValueError when T is outside 1..MATVEC_MAX_T (use gemm_<q>) or y's rows would overlap (ld_y < out).
    """
    assert kernel.startswith("matvec_"), f"{kernel} is not defined in matvec_quant.cu"
    if not 1 <= T <= MATVEC_MAX_T:
        raise ValueError(f"{kernel} takes 1..{MATVEC_MAX_T} token rows, got T={T}; use the gemm kernel")
    if out <= 0 or in_ <= 0 or ld_y < out:
        raise ValueError(f"{kernel}: need out > 0, in > 0 and ld_y >= out, got out={out} in={in_} ld_y={ld_y}")
    grid = ((out + MATVEC_ROWS_PER_CTA - 1) // MATVEC_ROWS_PER_CTA, 1, 1)
    return grid, (MATVEC_WARPS_PER_CTA * WARP_SIZE, 1, 1), 0
