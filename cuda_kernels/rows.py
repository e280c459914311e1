"""Launch geometry for rows.cu: one thread per output element."""
from __future__ import annotations

from cuda_kernels.launch import flat_geometry, unknown_kernel


def geometry(kernel: str, **ints: int):
    """(grid, block, dynamic shared bytes) from the kernel's int arguments (names as in its signature)."""
    elements = {
        "embedding_f32": lambda: ints["T"] * ints["d"],
        "add_f32": lambda: ints["n"],
        "split_columns_f32": lambda: ints["T"] * ints["out_cols"],
        "gather_rows_f32": lambda: ints["n_rows"] * ints["d"],
    }
    if kernel not in elements:
        raise unknown_kernel("rows.cu", kernel)
    return flat_geometry(elements[kernel]())
