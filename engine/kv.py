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
class KVLayout:
    """Shape of a KV pool: the same block ids address every layer."""

    num_blocks: int
    block_size: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.block_size * self.head_dim * np.dtype(self.dtype).itemsize

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks


def layout_for(config: ModelConfig, num_blocks: int, block_size: int = BLOCK_SIZE, dtype: str = "float32") -> KVLayout:
    # Recurrent layers (hybrid models) keep no K/V: the pool has a layer for each attention layer only.
    return KVLayout(num_blocks, block_size, config.n_kv_layers, config.n_kv_heads, config.head_dim, dtype)


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
