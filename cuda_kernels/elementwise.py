"""Launch geometry for elementwise.cu: one thread per output element."""
from __future__ import annotations

from cuda_kernels.launch import flat_geometry, unknown_kernel

_ELEMENTS = {  # kernel -> number of output elements, from its int arguments
    "embedding_f32": lambda a: a["T"] * a["d"],
    "add_f32": lambda a: a["n"],
    "mul_f32": lambda a: a["n"],
    "split_columns_f32": lambda a: a["T"] * a["out_cols"],
    "gather_rows_f32": lambda a: a["n_rows"] * a["d"],
    "gated_silu_f32": lambda a: a["T"] * a["F"],
    "gated_gelu_tanh_f32": lambda a: a["T"] * a["F"],
}


def geometry(kernel: str, **ints: int):
    """(grid, block, dynamic shared bytes) from the kernel's int arguments (names as in its signature)."""
    if kernel not in _ELEMENTS:
        raise unknown_kernel("elementwise.cu", kernel)
    return flat_geometry(_ELEMENTS[kernel](ints))
