"""The numpy host tier: parked KV blocks in host RAM, in segments added as the cache needs them.

Block-major, so a parked block is one contiguous piece: segment s holds host slots
[start_s, start_s + n_s) as k, v [n_s, layers, KVH, block_size, row] (a row: one token's stored K or V of one head, see
engine/kv_quant.py; int8 rows carry their scales, so parks and restores move them too). A segment is committed (every page
touched) when it is added, so a park into a slot the admission granted never meets a full RAM later;
nothing is committed for slots never granted.

    slots:    0 ........ 63 | 64 ....... 127 | 128 ...
    segments: [   seg 0     ][    seg 1      ][ seg 2 (added on the first park past 127) ...
"""
from __future__ import annotations

import bisect
from dataclasses import replace

import numpy as np

from engine.kv import KVLayout


class NumpyHostPool:
    """Host slots 0 .. num_blocks - 1 over a list of committed segments; `grow` adds one."""

    def __init__(self, layout: KVLayout):
        self.layout = layout  # num_blocks: slots committed so far
        self._starts: list[int] = []
        self._segments: list[tuple[np.ndarray, np.ndarray]] = []
        self._num_blocks = 0
        self.grow(layout.num_blocks)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._segments)

    def grow(self, num_blocks: int) -> None:
        """Commit slots up to num_blocks in total (one new segment); never shrinks."""
        count = num_blocks - self._num_blocks
        if count <= 0:
            return
        lay = self.layout
        shape = (count, lay.n_layers, lay.n_kv_heads, lay.block_size, lay.row_elems)
        k, v = np.empty(shape, dtype=lay.dtype), np.empty(shape, dtype=lay.dtype)
        k.fill(0)  # touch every page now: the RAM is taken when granted, not at some later park
        v.fill(0)
        self._starts.append(self._num_blocks)
        self._segments.append((k, v))
        self._num_blocks = num_blocks
        self.layout = replace(lay, num_blocks=num_blocks)

    def block(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Views (K, V) [layers, KVH, block_size, row] of one host slot."""
        assert 0 <= slot < self._num_blocks, f"host slot {slot} is not committed ({self._num_blocks} are)"
        s = bisect.bisect_right(self._starts, slot) - 1
        k, v = self._segments[s]
        return k[slot - self._starts[s]], v[slot - self._starts[s]]
