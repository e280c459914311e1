"""Launch geometry for kv_blocks.cu: store_kv one thread per element, block moves a capped grid-stride grid."""
from __future__ import annotations

from cuda_kernels.launch import ELEMENTWISE_THREADS, cdiv, flat_geometry, unknown_kernel

# Enough blocks to fill any current GPU several times over; the grid-stride loop covers the rest.
MAX_MOVE_BLOCKS = 4096
INT8_ROWS_PER_BLOCK = 4  # store_kv_int8: one warp per (token, head) row


def geometry(kernel: str, **ints: int):
    """(grid, block, dynamic shared bytes) from the kernel's int arguments (names as in its signature)."""
    if kernel == "store_kv_f32":
        return flat_geometry(ints["T"] * ints["KVH"] * ints["hd"])
    if kernel == "store_kv_f16":
        if ints["hd"] % 2:
            raise ValueError(f"store_kv_f16 needs an even head_dim, got {ints['hd']}")
        return flat_geometry(ints["T"] * ints["KVH"] * ints["hd"] // 2)
    if kernel == "store_kv_int8":
        if ints["hd"] % 4:
            raise ValueError(f"store_kv_int8 needs head_dim % 4 == 0 (its scale follows the row), got {ints['hd']}")
        rows = ints["T"] * ints["KVH"]
        return (max(1, cdiv(rows, INT8_ROWS_PER_BLOCK)), 1, 1), (32 * INT8_ROWS_PER_BLOCK, 1, 1), 0
    if kernel in ("copy_kv_blocks_f32", "gather_kv_blocks_f32", "scatter_kv_blocks_f32"):
        count = ints["n_pairs"] if kernel == "copy_kv_blocks_f32" else ints["n"]
        vec = 4 if ints["block_elems"] % 4 == 0 else 1
        vectors = count * ints["planes"] * (ints["block_elems"] // vec)
        blocks = min(MAX_MOVE_BLOCKS, max(1, cdiv(vectors, ELEMENTWISE_THREADS)))
        return (blocks, 1, 1), (ELEMENTWISE_THREADS, 1, 1), 0
    raise unknown_kernel("kv_blocks.cu", kernel)
