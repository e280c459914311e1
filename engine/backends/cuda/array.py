"""DeviceArray, the CUDA backend's activation handle, and the packing of one step's index arrays.

A DeviceArray is a device address with a shape and dtype. Its memory returns to the pool it came from when the
last reference dies (CPython frees deterministically, so a step's allocations follow the same pattern every
time, which keeps addresses stable for CUDA graphs). Views (reshape) keep their base alive instead.
"""
from __future__ import annotations

import math

import numpy as np

from engine.backends.cuda.arena import round_up
from engine.batch import BatchMeta


class DeviceArray:
    """Float32 (or index) array in device memory. `x + y` launches add_f32 on the owning backend's stream."""

    __slots__ = ("ptr", "shape", "dtype", "backend", "_release", "_base", "__weakref__")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype, backend, release=None, base=None):
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.backend = backend
        self._release = release  # called with ptr when this (owning) handle dies
        self._base = base  # the array a view was made from, kept alive by the view

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape) -> "DeviceArray":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        assert math.prod(shape) == self.size, f"cannot reshape {self.shape} to {shape}"
        return DeviceArray(self.ptr, shape, self.dtype, self.backend, base=self)

    def __add__(self, other: "DeviceArray") -> "DeviceArray":
        return self.backend.add(self, other)

    def __mul__(self, other: "DeviceArray") -> "DeviceArray":
        return self.backend.mul(self, other)

    def __getitem__(self, key) -> "DeviceArray":
        """x[:, a:b] of a [T, n] array: a contiguous copy of those columns (engine/short_conv.py's B | C | x
        split reads the fused projection this way); no other indexing exists on the device."""
        rows, cols = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
        assert self.ndim == 2 and rows == slice(None) and isinstance(cols, slice) and cols.step is None, \
            f"device arrays support x[:, a:b] only, not {key!r}"
        start, stop, _ = cols.indices(self.shape[1])
        return self.backend.columns(self, start, stop - start)

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, ptr={self.ptr:#x})"

    def __del__(self):
        release = self._release
        if release is not None:
            self._release = None
            release(self.ptr)


def step_arrays(batch: BatchMeta, max_blocks: int) -> dict[str, np.ndarray]:
    """The index arrays a forward step's kernels read, in the contract's dtypes.

    Block tables become one padded [n_seqs, max_blocks] int32 array (padding 0 is never read: a query at
    position p reads blocks 0 .. p // block_size of its own row only).
    """
    n_seqs = len(batch.seqs)
    tables = np.zeros((n_seqs, max_blocks), dtype=np.int32)
    token_seq = np.empty(batch.num_tokens, dtype=np.int32)
    for i, seq in enumerate(batch.seqs):
        used = min(len(seq.block_table), max_blocks)
        assert used * batch.block_size >= seq.context_len, f"block table of seq {i} is wider than {max_blocks}"
        tables[i, :used] = seq.block_table[:used]
        token_seq[seq.query_start : seq.query_start + seq.query_len] = i
    return {
        "token_ids": batch.token_ids.astype(np.int32),
        "positions": batch.positions.astype(np.int32),
        "slots": batch.slot_mapping.astype(np.int64),
        "token_seq": token_seq,
        "block_tables": tables.reshape(-1),
        "logit_rows": batch.logit_rows.astype(np.int64),
    }


def blocks_needed_by(batch: BatchMeta) -> int:
    """Widest block table the step reads (blocks covering each sequence's context)."""
    return max(-(-seq.context_len // batch.block_size) for seq in batch.seqs)


def pack_layout(arrays: dict[str, np.ndarray]) -> tuple[dict[str, int], int]:
    """Byte offset of each array in one buffer (256-aligned), and the total size."""
    offsets, total = {}, 0
    for name, array in arrays.items():
        offsets[name] = total
        total += round_up(max(array.nbytes, 1))
    return offsets, total


def registry_keys(batch: BatchMeta) -> dict[str, tuple[int, str]]:
    """How the ops find a packed array: (id of the batch's numpy array, dtype it is read as).

    The ops receive batch.token_ids, batch.positions, ... and look them up by identity; token_seq and the
    block tables have no numpy array in the batch, so they are keyed by the batch itself.
    """
    return {
        "token_ids": (id(batch.token_ids), "int32"),
        "positions": (id(batch.positions), "int32"),
        "slots": (id(batch.slot_mapping), "int64"),
        "token_seq": (id(batch), "token_seq"),
        "block_tables": (id(batch), "block_tables"),
        "logit_rows": (id(batch.logit_rows), "int64"),
    }
