"""A plan's victims, read off the eviction index (scheduler/cache/eviction_index.py) without changing it.

A plan removes blocks one by one in its head only: each choice can make a new candidate (a device parent
whose last device child was chosen, a host block whose last child above the disk left, a block this plan
parks). Those go on a small heap of the plan's own; the next victim is the smaller of that heap's top and
the index's next entry, skipping blocks the plan keeps (`exclude`) or took already. The index's entries
ahead of the cursor never change during a plan, so the cost is O(victims x log) whatever the tree's size,
and a refused plan leaves nothing to undo.
"""
from __future__ import annotations

import heapq
from typing import Iterator

from scheduler.cache.tree import CachedBlock
from scheduler.cache.eviction_index import EvictionIndex


class _Cursor:
    """Ascending (key, block) of one sorted set, merged with the plan's own candidates (a heap of the same)."""

    def __init__(self, index: EvictionIndex, keys: Iterator[tuple], skip):
        self._entries = ((key, index.block_of(key)) for key in keys)
        self._skip = skip  # skip(block): not a candidate for this plan
        self._head = next(self._entries, None)
        self.heap: list[tuple] = []  # keys are unique (they end in the block's seq): blocks never compared

    def pop(self) -> CachedBlock | None:
        while True:
            while self._head is not None and self._skip(self._head[1]):
                self._head = next(self._entries, None)
            if self.heap and (self._head is None or self.heap[0] < self._head):
                _, block = heapq.heappop(self.heap)
                if self._skip(block):
                    continue
                return block
            if self._head is None:
                return None
            block, self._head = self._head[1], next(self._entries, None)
            return block


def movable_device_weight(index: EvictionIndex, exclude: set[CachedBlock]) -> int:
    """Device slots that moving every unpinned device block off would free, less the kept ones'."""
    return index.device_weight - sum(index.weight(b) for b in exclude if b.on_device and b.ref_count == 0)


def device_victims(index: EvictionIndex, count: int, exclude: set[CachedBlock]) -> list[CachedBlock] | None:
    """The unpinned device blocks to move off to free `count` slots, best first, as if each left before the
    next is chosen (a parent ranks as a leaf once its last device child is chosen). A block frees its weight
    (1, plus its checkpoints' slots on a hybrid model). None when all of them would not free enough."""
    if movable_device_weight(index, exclude) < count:
        return None  # every unpinned device block not kept is a candidate: too few
    chosen: set[CachedBlock] = set()
    cursor = _Cursor(index, iter(index.device), lambda b: b in chosen or b in exclude)
    gone_children: dict[CachedBlock, int] = {}
    out: list[CachedBlock] = []
    freed = 0
    while freed < count:
        block = cursor.pop()
        assert block is not None, "device candidates ran out after the count said they would not"
        out.append(block)
        freed += index.weight(block)
        chosen.add(block)
        parent = block.parent
        if parent is not None and parent.on_device and parent.ref_count == 0 and parent not in exclude \
                and parent not in chosen:
            gone_children[parent] = gone_children.get(parent, 0) + 1
            left = index.device_children(parent) - gone_children[parent]
            heapq.heappush(cursor.heap, ((left > 0,) + index.device_key(parent)[1:], parent))
    return out


class HostLeaves:
    """Host and disk leaves as one plan moves blocks: the index's, less those this plan took, plus the
    blocks this plan parks and the host blocks whose last child above the disk this plan moved down."""

    def __init__(self, index: EvictionIndex, exclude: set[CachedBlock]):
        self.index, self.exclude = index, exclude
        self.parked: set[CachedBlock] = set()  # device -> host in this plan (their tier is host now)
        self._taken: set[CachedBlock] = set()  # host blocks this plan spills or drops
        self._disk_taken: set[CachedBlock] = set()
        self._copy_taken: set[CachedBlock] = set()  # written-behind files this plan deletes
        self._down: set[CachedBlock] = set()  # left the device / host tiers in this plan (spilled, dropped)
        self._upper: dict[CachedBlock, int] = {}  # children on device / host left, where the plan changed it
        self._order = 0  # the plan's parks rank after the index's blocks on a tie, as the old list did
        self._host = _Cursor(index, iter(index.host), lambda b: b in self._taken or b in exclude)
        self._disk = _Cursor(index, iter(index.disk), lambda b: b in self._disk_taken or b in exclude)
        self._copies = _Cursor(index, iter(index.copies), lambda b: b in self._copy_taken or b in self._down)

    def park(self, block: CachedBlock) -> None:
        """A device victim got a host slot: it is a host leaf of this plan once nothing above hangs from it."""
        self.parked.add(block)
        if self._upper_left(block) == 0:
            self._push(block)

    def move_down(self, block: CachedBlock) -> None:
        """`block` left the device or host tier (spilled, dropped): its parent may be a host leaf now."""
        self._down.add(block)
        parent = block.parent
        if parent is None or parent.parent is None:
            return  # a root
        self._upper[parent] = self._upper_left(parent) - 1
        on_host = (parent.on_host or parent in self.parked) and parent not in self._taken
        if self._upper[parent] == 0 and on_host and parent not in self.exclude:
            self._push(parent)

    def take_host_leaf(self) -> CachedBlock | None:
        block = self._host.pop()
        if block is not None:
            self._taken.add(block)
        return block

    def take_disk_leaf(self) -> CachedBlock | None:
        block = self._disk.pop()
        if block is not None:
            self._disk_taken.add(block)
        return block

    def leaving(self, block: CachedBlock) -> None:
        """`block` leaves its resident tier in this plan: its written-behind file is not one to delete."""
        self._copy_taken.add(block)

    def take_disk_copy(self) -> CachedBlock | None:
        """The least valuable resident block with a written-behind file (its file makes room)."""
        block = self._copies.pop()
        if block is not None:
            self._copy_taken.add(block)
        return block

    def _upper_left(self, block: CachedBlock) -> int:
        return self._upper.get(block, self.index.upper_children(block))

    def _push(self, block: CachedBlock) -> None:
        key = self.index.value_key(block)
        if block in self.parked:
            self._order += 1
            key = key[:3] + (float("inf"), self._order)
        heapq.heappush(self._host.heap, (key, block))
