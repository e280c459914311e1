"""The description of one forward step over several sequences (no arrays of activations, only indices).

A step packs every participating sequence's new tokens into one flat row range:

    rows:      [ seq0 new tokens | seq1 new tokens | seq2 ... ]
    positions:   p0 .. p0+n0-1     p1 .. p1+n1-1
    slots:       block_table0[pos // B] * B + pos % B  (where the token's K/V is written)

A sequence brings any number of new tokens (a prefill chunk or one decode token) at its own position;
its context after the step is positions 0 .. start_pos + query_len - 1, read through its block table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True, eq=False)
class SeqSlice:
    """One sequence's share of a batch."""

    query_start: int  # first row of this sequence in the flat batch
    query_len: int  # number of new tokens
    start_pos: int  # position of the first new token (== tokens already in its KV)
    block_table: np.ndarray  # int32 block ids covering positions 0 .. context_len - 1
    state_slot: int = -1  # hybrid models: the row of the recurrent-state pools this sequence reads and writes

    @property
    def context_len(self) -> int:
        return self.start_pos + self.query_len

    def key_runs(self, block_size: int, first_key: int = 0) -> list[tuple[int, int, int]]:
        """Maximal runs of consecutive block ids covering keys first_key .. context_len - 1.

        Returns (first key position, number of keys, first slot) per run, so a backend can read each run
        as one contiguous view of the pool instead of gathering the whole context every step.
        """
        return _key_runs(self._table_runs(block_size), first_key, self.context_len, block_size)

    def _table_runs(self, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        cache = self.__dict__.setdefault("_runs_cache", {})
        if block_size not in cache:
            num_blocks = -(-self.context_len // block_size)
            table = self.block_table[:num_blocks].astype(np.int64)
            breaks = np.flatnonzero(np.diff(table) != 1) + 1
            starts = np.concatenate(([0], breaks))
            cache[block_size] = (starts, table[starts])
        return cache[block_size]


def _key_runs(runs: tuple[np.ndarray, np.ndarray], first_key: int, context_len: int, block_size: int):
    run_first_blocks, run_first_ids = runs
    num_blocks = -(-context_len // block_size)
    run_ends = np.append(run_first_blocks[1:], num_blocks)
    out = []
    for first_block, end_block, block_id in zip(run_first_blocks, run_ends, run_first_ids):
        key_start = max(int(first_block) * block_size, first_key)
        key_end = min(int(end_block) * block_size, context_len)
        if key_end <= key_start:
            continue
        slot = int(block_id) * block_size + key_start - int(first_block) * block_size
        out.append((key_start, key_end - key_start, slot))
    return out


@dataclass(frozen=True, eq=False)
class BatchMeta:
    """Indices for one batched forward step."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, flat KV slot each new token is written to
    seqs: tuple[SeqSlice, ...]
    logit_rows: np.ndarray  # rows whose logits are returned (default: the last row of every sequence)
    block_size: int = field(default=16)
    # Rows whose K/V the step writes; None: all. A state window's rows (engine/state_window.py) read the
    # cached K/V of their positions and write none.
    kv_write_rows: np.ndarray | None = None
    # slot_mapping with -1 on the rows kv_write_rows leaves out (the CUDA store_kv kernels skip negative
    # slots); None when every row writes. Built once per step, read by every layer.
    store_slot_mapping: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def build_batch(
    items: Sequence[tuple[Sequence[int], int, np.ndarray]],
    block_size: int,
    all_logits: bool = False,
    state_slots: Sequence[int] | None = None,
    state_windows: Sequence[int] | None = None,
) -> BatchMeta:
    """Pack (new token ids, start position, block table) per sequence into a BatchMeta.

    With all_logits the logits of every row come back (reference tests); otherwise only each sequence's
    last row, which is all that sampling needs. `state_slots` (hybrid models): each sequence's state row.
    `state_windows`: per sequence, how many of its first rows are a state window (they write no K/V).
    """
    seqs, ids, positions, logit_rows, writes = [], [], [], [], []
    row = 0
    for index, (new_ids, start_pos, table) in enumerate(items):
        n = len(new_ids)
        if n == 0:
            raise ValueError("every sequence in a batch must bring at least one new token")
        table = np.asarray(table, dtype=np.int32)
        if len(table) * block_size < start_pos + n:
            raise ValueError(
                f"block table of {len(table)} blocks cannot hold {start_pos + n} tokens (block size {block_size})"
            )
        state_slot = -1 if state_slots is None else int(state_slots[index])
        seqs.append(SeqSlice(row, n, int(start_pos), table, state_slot))
        ids.append(np.asarray(new_ids, dtype=np.int64))
        pos = np.arange(start_pos, start_pos + n, dtype=np.int64)
        positions.append(pos)
        logit_rows.append(np.arange(row, row + n) if all_logits else np.array([row + n - 1]))
        window = 0 if state_windows is None else int(state_windows[index])
        assert 0 <= window < n, f"a state window of {window} rows in a step of {n}"
        writes.append(np.arange(row + window, row + n))
        row += n
    positions_flat = np.concatenate(positions)
    slot_mapping = np.concatenate(
        [s.block_table[p // block_size].astype(np.int64) * block_size + p % block_size for s, p in zip(seqs, positions)]
    )
    kv_write_rows, store_slot_mapping = None, None
    if row != sum(map(len, writes)):
        kv_write_rows = np.concatenate(writes).astype(np.int64)
        store_slot_mapping = np.full_like(slot_mapping, -1)
        store_slot_mapping[kv_write_rows] = slot_mapping[kv_write_rows]
    return BatchMeta(
        token_ids=np.concatenate(ids),
        positions=positions_flat,
        slot_mapping=slot_mapping,
        seqs=tuple(seqs),
        logit_rows=np.concatenate(logit_rows).astype(np.int64),
        block_size=block_size,
        kv_write_rows=kv_write_rows,
        store_slot_mapping=store_slot_mapping,
    )


def store_slots(batch: BatchMeta) -> np.ndarray:
    """The slot each row's K/V goes to, -1 for a state window's rows (they write none)."""
    return batch.slot_mapping if batch.store_slot_mapping is None else batch.store_slot_mapping
