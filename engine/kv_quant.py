"""The K/V row codecs of `--kv-type`: how a token's K (or V) of one head becomes the bytes of a pool row.

    f32:   [hd] float32
    f16:   [hd] float16
    int8:  [hd] int8 | float32 scale (4 bytes seen as 4 more int8 elements)   x ~= q * scale

int8 is symmetric with one scale per token, head and K/V: scale = max|x| / 127, q = rint(x * (127 / max|x|))
(round half to even, clipped to +-127; an all-zero row has scale 0). The scale depends on that row only, so
a token's stored bytes are the same whatever the chunking of the prompt, the prefix reused or the order of
writes into a block (a per-block scale would have to re-quantise a block as it fills, and its bytes would
depend on how the block was filled). These functions are the numpy reference of the CUDA kernels: every
step is one float32 operation in the same order, so the kernels give the same bytes.
"""
from __future__ import annotations

import numpy as np

_F32 = np.float32
_QMAX = _F32(127.0)


def encode_rows(x: np.ndarray, kv_type: str) -> np.ndarray:
    """x [..., hd] float32 -> stored rows [..., row_elems] of the type's storage dtype."""
    if kv_type == "f32":
        return np.asarray(x, dtype=_F32)
    if kv_type == "f16":
        return np.asarray(x, dtype=np.float16)
    assert kv_type == "int8", f"unknown K/V type {kv_type!r}"
    x = np.asarray(x, dtype=_F32)
    amax = np.abs(x).max(axis=-1, keepdims=True)  # [..., 1]
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, _QMAX / amax, _F32(0.0)).astype(_F32)
    rows = np.empty(x.shape[:-1] + (x.shape[-1] + 4,), dtype=np.int8)
    rows[..., :-4] = np.clip(np.rint(x * inv), -_QMAX, _QMAX)
    rows[..., -4:] = np.ascontiguousarray(amax / _QMAX, dtype=_F32).view(np.int8)
    return rows


def split_rows(rows: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Stored rows [..., row_elems] -> (values [..., hd] in storage dtype, scale [...] float32 or None).

    Views, no copy, so attention can read a run of blocks as it lies in the pool."""
    if rows.dtype != np.int8:
        return rows, None
    return rows[..., :head_dim], rows[..., head_dim:head_dim + 4].view(_F32)[..., 0]


def decode_rows(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Stored rows [..., row_elems] -> float32 [..., hd] (tests, tools; attention folds the scale in)."""
    values, scale = split_rows(rows, head_dim)
    out = values.astype(_F32)
    return out if scale is None else out * scale[..., None]
