"""Write-behind to the disk tier: computed blocks reach disk while the server runs, not only at a clean stop.

Without it the disk tier receives blocks only when the host tier spills and at shutdown, so after a
`kill -9` or an OOM kill a restart finds nothing. Here every block that joins the cache tree is queued
(`PrefixCache.unsaved`); the engine loop calls `tick` a few times a second and it writes a bounded
number of bytes, newest conversation first, each block after its parent (a file whose parent has none
would be unreachable after a restart). A written block stays where it is, with `disk_copy` set: a later
spill of it costs no write, a shutdown flush skips it, and a restart finds it.

Blocks are read and written on the loop thread, between the loop's own decisions, so no plan can move or
drop a block while its bytes are copied; the byte budget per tick keeps that pause short.
"""
from __future__ import annotations

import heapq
import logging
import time

from scheduler.cache_tree import CachedBlock
from scheduler.prefix_cache import PrefixCache

log = logging.getLogger("strata.cache.disk")

TICK_S = 0.25  # how often the loop offers the write-behind a turn while blocks are unsaved


class WriteBehind:
    """Writes unsaved cache blocks to the disk tier at up to `mib_per_s`, newest conversations first."""

    def __init__(self, cache: PrefixCache, block_bytes: int, mib_per_s: float):
        assert mib_per_s > 0 and block_bytes > 0
        self.cache = cache
        self.block_bytes = block_bytes
        self.bytes_per_s = mib_per_s * 2**20
        self.last_tick = time.monotonic()
        self.written_blocks = 0
        self.failed_blocks = 0

    @property
    def has_work(self) -> bool:
        return bool(self.cache.unsaved) and self.cache.disk_free > 0

    def tick(self, now: float | None = None) -> int:
        """Write what this turn's byte budget allows (at least one block); returns blocks written."""
        now = time.monotonic() if now is None else now
        elapsed, self.last_tick = now - self.last_tick, now
        budget = max(1, int(min(elapsed, 1.0) * self.bytes_per_s) // self.block_bytes)
        written = 0
        for block in self._order(budget):
            if written >= budget or self.cache.disk_free <= 0:
                break
            if not self.cache.mover.save(block):
                self.failed_blocks += 1
                break  # the disk refuses (full, unwritable): try again next turn, the blocks stay cached
            self.cache.record_disk_copy(block)
            written += 1
        self.written_blocks += written
        return written

    def _order(self, budget: int):
        """Unsaved blocks, the most recently used conversation first, every block after its parent. Only the
        newest few tips are ranked (a turn writes `budget` blocks), so a tick costs O(n log budget)."""
        unsaved = self.cache.unsaved
        for tip in heapq.nlargest(2 * budget, unsaved.values(), key=lambda b: b.last_used):
            if id(tip) not in unsaved:
                continue  # written already, as an ancestor of a newer tip
            for block in _unsaved_path(tip, unsaved):
                yield block


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
