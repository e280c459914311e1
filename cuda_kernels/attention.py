"""Launch geometry for attention.cu: one 4-warp block per (query row, head), split-K over key chunks."""
from __future__ import annotations

from cuda_kernels.launch import MAX_GRID_X, cdiv, unknown_kernel

ATTENTION_THREADS = 128  # ATTN_WARPS * 32 in attention.cu
MAX_HEAD_DIM = 256  # ATTN_MAX_HD in attention.cu
MAX_CHUNKS = 65535  # gridDim.y limit
DEFAULT_DYNAMIC_SHARED_LIMIT = 48 * 1024  # without cuFuncSetAttribute opt-in, on every arch
KV_TYPES = ("f32", "f16", "int8")  # one kernel pair per --kv-type, one geometry for all
DIRECT_KERNELS = tuple(f"paged_attention_{t}" for t in KV_TYPES)
SPLIT_KERNELS = tuple(f"paged_attention_split_{t}" for t in KV_TYPES)


def num_chunks(max_blocks: int, block_size: int, chunk_keys: int, window: int = 0) -> int:
    """Key chunks per (row, head) for paged_attention_split_f32: enough for the longest possible key range
    (a full block table, or the window). The partial buffers are sized [T * H, n_chunks, (hd)] by it, and
    attention_combine_f32 gets it as n_chunks."""
    if chunk_keys <= 0:
        raise ValueError(f"chunk_keys must be positive, got {chunk_keys}")
    max_keys = max_blocks * block_size
    if window > 0:
        max_keys = min(max_keys, window)
    return min(MAX_CHUNKS, max(1, cdiv(max_keys, chunk_keys)))


def geometry(kernel: str, **ints: int):
    """(grid, block, dynamic shared bytes) from the kernel's int arguments (names as in its signature)."""
    rows = ints["T"] * ints["H"]
    if not 0 < ints["hd"] <= MAX_HEAD_DIM:
        raise ValueError(f"attention kernels support head_dim 1..{MAX_HEAD_DIM}, got {ints['hd']}")
    if rows > MAX_GRID_X:
        raise ValueError(f"T * H = {rows} query rows exceed one launch")
    grid_rows = max(1, rows)
    if kernel in DIRECT_KERNELS:
        _check_gqa(ints)
        return (grid_rows, 1, 1), (ATTENTION_THREADS, 1, 1), 0
    if kernel in SPLIT_KERNELS:
        _check_gqa(ints)
        chunks = num_chunks(ints["max_blocks"], ints["block_size"], ints["chunk_keys"], ints.get("window", 0))
        if chunks * ints["chunk_keys"] < min(ints["max_blocks"] * ints["block_size"], ints.get("window") or 2**62):
            raise ValueError(f"chunk_keys {ints['chunk_keys']} too small: more than {MAX_CHUNKS} chunks")
        return (grid_rows, chunks, 1), (ATTENTION_THREADS, 1, 1), 0
    if kernel in ("attention_combine_f32", "attention_combine_sinks_f32"):
        threads = min(MAX_HEAD_DIM, 32 * cdiv(ints["hd"], 32))
        shared_bytes = 4 * ints["n_chunks"]
        if shared_bytes > DEFAULT_DYNAMIC_SHARED_LIMIT:
            raise ValueError(f"n_chunks {ints['n_chunks']} needs {shared_bytes} B of shared memory; raise chunk_keys")
        return (grid_rows, 1, 1), (threads, 1, 1), shared_bytes
    raise unknown_kernel("attention.cu", kernel)


def _check_gqa(ints: dict[str, int]) -> None:
    if ints["KVH"] <= 0 or ints["H"] % ints["KVH"]:
        raise ValueError(f"H = {ints['H']} query heads must be a multiple of KVH = {ints['KVH']}")
