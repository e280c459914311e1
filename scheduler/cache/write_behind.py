"""Write-behind to the disk tier: computed blocks reach disk while the server runs, not only at a clean stop.

Without it the disk tier receives blocks only when the host tier spills and at shutdown, so after a
`kill -9` or an OOM kill a restart finds nothing. Here every block that joins the cache tree is queued
(`PrefixCache.unsaved`); the engine loop calls `tick` a few times a second and it writes a bounded
number of bytes, newest conversation first, each block after its parent (a file whose parent has none
would be unreachable after a restart). A written block stays where it is, with `disk_copy` set: a later
spill of it costs no write, a shutdown flush skips it, and a restart finds it.

Blocks are read and written on the loop thread, between the loop's own decisions, so no plan can move or
drop a block while its bytes are copied; the byte budget per tick keeps that pause short.

Hybrid models (scheduler/cache/checkpoints.py): a node's state checkpoints are written right after its block
(a restart attaches a checkpoint file only to a block it found), from the same byte budget and in the same
order; a checkpoint taken later on a block written already (a reply's end on a shared block) is written
when its node's turn comes, newest first. Without them a restart would reuse a hybrid conversation only
up to the checkpoints that happened to be spilled.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time

from engine.units import MIB
from scheduler.cache.tree import CachedBlock
from scheduler.cache.prefix_cache import PrefixCache

log = logging.getLogger("strata.cache.disk")

TICK_S = 0.25  # how often the loop offers the write-behind a turn while blocks are unsaved


class WriteBehind:
    """Writes unsaved cache blocks (and their checkpoints) to the disk tier at up to `mib_per_s`, newest
    conversations first."""

    def __init__(self, cache: PrefixCache, block_bytes: int, mib_per_s: float):
        assert mib_per_s > 0 and block_bytes > 0
        self.cache = cache
        self.ckpt = cache.ckpt
        self.block_bytes = block_bytes
        self.state_bytes = self.ckpt.store.state_bytes if self.ckpt.enabled else block_bytes
        self.bytes_per_s = mib_per_s * MIB
        self.last_tick = time.monotonic()
        self.written_blocks = 0
        self.written_checkpoints = 0
        self.failed_blocks = 0  # failed writes, of blocks or checkpoints

    @property
    def has_work(self) -> bool:
        free = self.cache.disk_free
        return bool(self.cache.unsaved) and free > 0 or bool(self.ckpt.unsaved) and free >= self.ckpt.units

    def tick(self, now: float | None = None) -> int:
        """Write what this turn's byte budget allows (at least one file); returns files written (blocks
        and checkpoints)."""
        now = time.monotonic() if now is None else now
        elapsed, self.last_tick = now - self.last_tick, now
        budget_bytes = min(elapsed, 1.0) * self.bytes_per_s
        spent_bytes, written = 0, 0
        for node, k in self._order(1 + int(budget_bytes // min(self.block_bytes, self.state_bytes))):
            cost = self.block_bytes if k is None else self.state_bytes
            if written and spent_bytes + cost > budget_bytes:
                break
            free = self.cache.disk_free
            if free <= 0:
                break
            if k is not None and free < self.ckpt.units:
                continue  # no room for a state: the blocks after it may still fit
            if not self._write(node, k):
                self.failed_blocks += 1
                break  # the disk refuses (full, unwritable): try again next turn, everything stays cached
            spent_bytes += cost
            written += 1
        return written

    def _write(self, node: CachedBlock, k: int | None) -> bool:
        """One file: the node's block (k None) or its checkpoint after k tokens."""
        if k is not None:
            ok = self.ckpt.save(node, k)
            self.written_checkpoints += ok
            return ok
        if not self.cache.mover.save(node):
            return False
        self.cache.tiers.record_disk_copy(node)
        self.written_blocks += 1
        return True

    def _order(self, count: int):
        """(node, None) for an unsaved block and (node, k) for an unsaved checkpoint, the most recently used
        conversation first, every block after its parent and every checkpoint after its block. Only the
        newest `count` tips are ranked (a turn writes at most `count` files), so a tick costs
        O(n log count). Lazy: each item is asked for after the one before it was written."""
        unsaved, pending = self.cache.unsaved, self.ckpt.unsaved
        tips = heapq.nlargest(count, itertools.chain(unsaved.values(), pending.values()), key=lambda b: b.last_used)
        for tip in tips:
            for block in _unsaved_path(tip, unsaved):
                yield block, None
                if block.disk_copy:  # written (else the tick stopped): its states may follow
                    yield from ((block, k) for k in self.ckpt.unsaved_of(block))
            if id(tip) in pending and tip.disk_copy:  # a block written before its checkpoint was taken
                yield from ((tip, k) for k in self.ckpt.unsaved_of(tip))


def _unsaved_path(block: CachedBlock, unsaved: dict[int, CachedBlock]) -> list[CachedBlock]:
    """The unsaved blocks from the first one missing on disk down to `block`, parents first."""
    path = []
    node = block
    while node.parent is not None and id(node) in unsaved:
        path.append(node)
        node = node.parent
    if node.parent is not None and not (node.on_disk or node.disk_copy):
        return []  # an ancestor is neither on disk nor queued (being replaced): wait for it
    return path[::-1]
