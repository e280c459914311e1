"""A sequence being computed, and the runner that advances several of them in one batched step.

There is no prefill or decode phase: a sequence has token_ids and num_computed (tokens whose K/V is in
its blocks). A step computes the next `n` uncomputed tokens of each chosen sequence; n = 1 on a sequence
with one pending token is a decode step, a larger n a prefill chunk. One rule covers both.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.batch import build_batch
from engine.kv import BlockAllocator, blocks_needed, layout_for
from engine.model import Model


@dataclass
class Sequence:
    """Token ids (prompt + generated) and where their K/V lives."""

    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed


class ModelRunner:
    """Owns a model's KV pool and allocator; runs one batched forward over chosen sequences."""

    def __init__(self, model: Model, num_blocks: int, block_size: int = 16, host_blocks: int = 0):
        self.model = model
        self.block_size = block_size
        self.layout = layout_for(model.config, num_blocks, block_size)
        self.kv_pool = model.backend.create_kv_pool(self.layout)
        self.host_layout = layout_for(model.config, host_blocks, block_size)
        self.host_pool = model.backend.create_host_pool(self.host_layout) if host_blocks else None
        self.allocator = BlockAllocator(num_blocks)

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens; False (nothing changed) when the pool is full."""
        missing = blocks_needed(num_tokens, self.block_size) - len(seq.block_table)
        if missing <= 0:
            return True
        fresh = self.allocator.allocate(missing)
        if fresh is None:
            return False
        seq.block_table.extend(fresh)
        return True

    def move_blocks(self, parks, restores, copies) -> None:
        """Run a cache allocation's copies in the order that keeps them safe: device -> host parks, then
        host -> device restores, then device -> device copy-on-write. Only between steps."""
        backend = self.model.backend
        if parks:
            backend.park_blocks(self.kv_pool, self.host_pool, parks)
        if restores:
            backend.restore_blocks(self.host_pool, self.kv_pool, restores)
        if copies:
            backend.copy_blocks(self.kv_pool, copies)

    def read_block(self, tier: str, index: int):
        """Copy of one block's (K, V) from the device pool or the host pool, as numpy arrays."""
        pool = self.kv_pool if tier == "device" else self.host_pool
        return self.model.backend.read_block(pool, index)

    def write_block(self, device_id: int, k, v) -> None:
        self.model.backend.write_block(self.kv_pool, device_id, k, v)

    def release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

    def step(self, work: list[tuple[Sequence, int]], all_logits: bool = False) -> np.ndarray:
        """Compute the next n pending tokens of each (sequence, n); returns logits rows.

        Without all_logits the result has one row per sequence (its last computed token); blocks must
        already be reserved with ensure_blocks.
        """
        items = []
        for seq, n in work:
            assert 0 < n <= seq.num_pending, f"asked for {n} tokens of a sequence with {seq.num_pending} pending"
            start = seq.num_computed
            items.append((seq.token_ids[start : start + n], start, np.asarray(seq.block_table, dtype=np.int32)))
        batch = build_batch(items, self.block_size, all_logits=all_logits)
        run_forward = getattr(self.model.backend, "run_forward", None)  # cuda: graph replay of decode steps
        if run_forward is not None:
            logits = run_forward(self.model, batch, self.kv_pool)
        else:
            logits = self.model.forward(batch, self.kv_pool)
        for seq, n in work:
            seq.num_computed += n
        return logits
