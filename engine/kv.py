"""Paged KV memory: a pool of fixed-size blocks and a free list. Bytes and bookkeeping only, no policy.

Which blocks to keep, share or evict is the conversation cache's business (scheduler/); the engine only
needs to know where each token's K/V lives: slot = block_id * block_size + offset.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from engine.config import ModelConfig

BLOCK_SIZE = 16  # tokens per KV block of the server (tests pick smaller ones explicitly)


@dataclass(frozen=True)
class KVType:
    """How one token's K (or V) of one head is stored: a row of `head_dim` values of `storage`, followed
    by `scale_bytes` bytes (int8: the row's float32 scale, so x = q * scale; see engine/kv_quant.py)."""

    name: str
    storage: str  # numpy dtype name of the stored values
    scale_bytes: int

    def row_elems(self, head_dim: int) -> int:
        """Storage elements of one row: the values, then the scale's bytes seen as elements."""
        return head_dim + self.scale_bytes // np.dtype(self.storage).itemsize

    def row_bytes(self, head_dim: int) -> int:
        return self.row_elems(head_dim) * np.dtype(self.storage).itemsize


# --kv-type: one float32 scale per token, head and K/V for int8 (why per token: docs/BENCHMARKS.md).
KV_TYPES = {"f32": KVType("f32", "float32", 0), "f16": KVType("f16", "float16", 0), "int8": KVType("int8", "int8", 4)}


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV pool: the same block ids address every layer. The one owner of K/V bytes per token
    and per block (the pool, the host tier, the disk tier and the admission all size from here)."""

    num_blocks: int
    block_size: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    kv_type: str = "f32"  # a key of KV_TYPES

    def __post_init__(self) -> None:
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"--kv-type {self.kv_type!r} is not one of: {', '.join(KV_TYPES)}")

    @property
    def type(self) -> KVType:
        return KV_TYPES[self.kv_type]

    @property
    def dtype(self) -> str:
        """numpy dtype of the stored elements (int8 rows carry their scale's bytes as 4 more elements)."""
        return self.type.storage

    @property
    def row_elems(self) -> int:
        """Last axis of every pool array: head_dim values (+ the scale's bytes for int8)."""
        return self.type.row_elems(self.head_dim)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.type.row_bytes(self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks


def layout_for(config: ModelConfig, num_blocks: int, block_size: int = BLOCK_SIZE, kv_type: str = "f32") -> KVLayout:
    # Recurrent layers (hybrid models) keep no K/V: the pool has a layer for each attention layer only, so
    # bytes_per_token / bytes_per_block count those alone.
    return KVLayout(num_blocks, block_size, config.n_kv_layers, config.n_kv_heads, config.head_dim, kv_type)


def resolve_kv_type(requested: str, backend) -> str:
    """--kv-type resolved for a backend: `auto` is the backend's first supported type (its default);
    a type the backend cannot run is a ValueError that names the ones it can."""
    supported = backend.capabilities.kv_types
    if requested == "auto":
        return supported[0]
    if requested not in supported:
        raise ValueError(f"--kv-type {requested} is not supported by the {backend.name} backend "
                         f"(it runs: {', '.join(supported)})")
    return requested


class BlockAllocator:
    """Free list over block ids 0 .. num_blocks - 1.

    `allocate` returns None when there is not enough room (no exception: running out is a normal outcome
    the caller decides about). Blocks come out in ascending order from a fresh pool, so a sequence's table
    is usually one contiguous run, which the numpy attention reads as a single view.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = np.ones(num_blocks, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        """The free ids in the order `allocate` hands them out."""
        return list(self._free)

    def is_free(self, block_id: int) -> bool:
        return bool(self._is_free[block_id])

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(count)]
        self._is_free[ids] = False
        return ids

    def grow(self, count: int) -> None:
        """Add ids num_blocks .. num_blocks + count - 1, free, at the end of the free list."""
        self._free.extend(range(self.num_blocks, self.num_blocks + count))
        self._is_free = np.concatenate([self._is_free, np.ones(count, dtype=bool)])
        self.num_blocks += count

    def take(self, block_id: int) -> None:
        """Allocate one particular free id (a block relocated there when the pool shrinks)."""
        assert self._is_free[block_id], f"block {block_id} is not free"
        self._free.remove(block_id)
        self._is_free[block_id] = False

    def shrink(self, num_blocks: int) -> None:
        """Drop ids num_blocks and up, every one of which must be free (the pool gives them back)."""
        assert self._is_free[num_blocks:].all(), "shrinking over blocks in use"
        self._free = deque(b for b in self._free if b < num_blocks)
        self._is_free = self._is_free[:num_blocks].copy()
        self.num_blocks = num_blocks

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the pool; freeing a block twice is a bug and asserts."""
        ids = list(block_ids)
        assert not self._is_free[ids].any(), f"double free of blocks {[b for b in ids if self._is_free[b]]}"
        self._is_free[ids] = True
        self._free.extend(ids)

    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free), "duplicate ids in the free list"
        assert int(self._is_free.sum()) == len(self._free), "free flags disagree with the free list"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens: the one rounding rule of the KV pool, used everywhere."""
    return -(-num_tokens // block_size)
