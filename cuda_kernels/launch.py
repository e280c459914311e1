"""Helpers shared by the companion geometry modules (`norms.py` next to `norms.cu`, ...)."""
from __future__ import annotations

MAX_GRID_X = 2**31 - 1
ELEMENTWISE_THREADS = 256


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def flat_geometry(elements: int, threads: int = ELEMENTWISE_THREADS):
    """One thread per element over a flat index: (grid, block, 0). At least one block (a no-op launch
    beats a zero-sized grid, which the driver rejects)."""
    blocks = max(1, cdiv(elements, threads))
    if blocks > MAX_GRID_X:
        raise ValueError(f"{elements} elements exceed one launch of {threads}-thread blocks")
    return (blocks, 1, 1), (threads, 1, 1), 0


def row_block_threads(n: int, max_threads: int = 1024) -> int:
    """Threads for one-block-per-row kernels: a multiple of 32, about 4 elements per thread, at most max_threads."""
    return max(32, min(max_threads, 32 * cdiv(cdiv(n, 4), 32)))


def unknown_kernel(module: str, kernel: str) -> ValueError:
    return ValueError(f"{module} defines no kernel {kernel!r}")
