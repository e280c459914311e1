"""Launch geometry of gemm_quant.cu (`gemm_<q>`, prefill: tensor-core products for any T).

A CTA computes a GEMM_BM x GEMM_BN tile of (output features x token rows) with 4 warps; its two fp16 tiles
are static shared memory (18 KiB), so no dynamic shared memory is requested.
"""
from __future__ import annotations

GEMM_BM = 64        # output features per CTA; must match gemm_quant.cu
GEMM_BN = 64        # token rows per CTA
GEMM_THREADS = 128

Dim3 = tuple[int, int, int]


def geometry(kernel: str, *, T: int, out: int, in_: int, ld_y: int) -> tuple[Dim3, Dim3, int]:
    """(grid, block, dynamic shared bytes) for gemm_<q>(y, W, x, bias, T, out, in, ld_y).

    Grid x walks output features, grid y token rows (y has room for 65535 * 64 rows).
    ValueError for an empty product or overlapping rows of y (ld_y < out).
    """
    assert kernel.startswith("gemm_"), f"{kernel} is not defined in gemm_quant.cu"
    if T <= 0 or out <= 0 or in_ <= 0 or ld_y < out:
        raise ValueError(f"{kernel}: need T, out, in > 0 and ld_y >= out, got T={T} out={out} in={in_} ld_y={ld_y}")
    grid = ((out + GEMM_BM - 1) // GEMM_BM, (T + GEMM_BN - 1) // GEMM_BN, 1)
    return grid, (GEMM_THREADS, 1, 1), 0
