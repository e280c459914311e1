"""The conversation cache's eviction candidates per tier, kept in value order as blocks move.

The rule (scheduler/cache/room.py) is the one the full scans of issue 12's first plans applied; only its cost
changed. Instead of ranking every cached block on each plan, the cache calls `sync(block)` after it changes a
block (tier, pin, last use, a child attached or detached), and this index updates, in O(log n):

    device  every unpinned device block   (has a device child, not superseded, active, last_used, seq)
    host    host blocks with no child on the device or in host RAM   (not superseded, active, last_used, seq)
    disk    disk blocks with no child at all                         (not superseded, active, last_used, seq)
    copies  resident blocks with a written-behind file               (not superseded, active, last_used, seq)

Smallest key = evicted first: leaves before the heads they hang from, superseded reply tails first, then
one-off prompts before the blocks of an active conversation (scheduler/cache/conversation_activity.py), then least
recently used. Last use is unique except among blocks loaded from disk (all 0); there `seq`, the order blocks
entered their tier, breaks the tie as the old scans' dict order did.
A block becomes a host or disk candidate when its last child in the tiers above leaves (its parent's child
counters drop to zero). Plans read these sets in order without changing them (scheduler/cache/eviction_sim.py).
"""
from __future__ import annotations

import itertools
from typing import Callable

from sortedcontainers import SortedSet

from scheduler.cache.tree import CachedBlock, is_superseded


class _Record:
    """What the index last saw of one cached block, and the keys it holds for it."""

    __slots__ = ("tier", "attached", "seq", "device_children", "host_children", "superseded", "keys", "weight")
    # keys: plain tuples of numbers (the seq names the block), which the garbage collector stops tracking

    def __init__(self):
        self.tier: str | None = None  # None: in no tier (being moved, or gone)
        self.attached = False
        self.seq = 0
        self.device_children = 0  # children whose recorded tier is "device"
        self.host_children = 0
        self.superseded = False
        self.keys: tuple = (None, None, None, None)  # its entry in device / host / disk / copies, if any
        self.weight = 0  # device slots it frees, counted in device_weight while it is in the device set


_TIERS = ("device", "host", "disk", "copies")


class EvictionIndex:
    """Candidates of each tier in eviction order; exact after every `sync`. Mutated by the cache only."""

    def __init__(self, block_size: int, is_active: Callable[[CachedBlock], bool] = lambda block: False,
                 weight: Callable[[CachedBlock], int] = lambda block: 1):
        self.block_size = block_size
        self.is_active = is_active  # the block's conversation is active: it ranks after one-off prompts
        # Device slots a block frees when it leaves the device: 1, plus its state checkpoints' (hybrid models,
        # scheduler/cache/checkpoints.py). It never changes the order, only how many victims a count needs.
        self.weight = weight
        self.device_weight = 0  # sum of the device set's weights
        # Sorted sets (sortedcontainers): O(log n) add and remove, in-order reads that change nothing. Keys are
        # unique (each ends in its block's seq); `_set_keys` asserts a key it adds is not there already.
        self.device, self.host, self.disk, self.copies = SortedSet(), SortedSet(), SortedSet(), SortedSet()
        self._sets = (self.device, self.host, self.disk, self.copies)
        self._records: dict[CachedBlock, _Record] = {}
        self._blocks: dict[int, CachedBlock] = {}  # seq -> block, for every block the index holds
        self._seq = itertools.count(1)

    @property
    def num_unpinned_device(self) -> int:
        """Unpinned device blocks: each can be moved off to make room."""
        return len(self.device)

    def device_children(self, block: CachedBlock) -> int:
        return self._records[block].device_children

    def block_of(self, key: tuple) -> CachedBlock:
        return self._blocks[key[-1]]

    def device_key(self, block: CachedBlock) -> tuple:
        """The entry of an unpinned device block in the device set."""
        return self._records[block].keys[0]

    def value_key(self, block: CachedBlock) -> tuple:
        """The key a block would have as a host or disk candidate, wherever it is now."""
        return self._value(block, self._records[block])

    def upper_children(self, block: CachedBlock) -> int:
        """Children of a cached block on the device or in host RAM."""
        record = self._records[block]
        return record.device_children + record.host_children

    def sync(self, block: CachedBlock) -> None:
        """Bring the index up to date with `block` after the cache changed it (any change, any tier)."""
        parent = block.parent
        attached = parent is not None and parent.children.get(block.tokens) is block
        tier = block.tier if attached and (block.on_device or block.on_host or block.on_disk) else None
        record = self._records.get(block)
        if record is None:
            if tier is None:
                return
            record = self._records[block] = self._new_record(block)
        moved, relinked = tier != record.tier, attached != record.attached
        parent_record = self._records.get(parent)
        if moved:
            if parent_record is not None:
                self._count_child(parent_record, record.tier, -1)
                self._count_child(parent_record, tier, +1)
            self._blocks.pop(record.seq, None)
            record.tier, record.seq = tier, next(self._seq)
            self._blocks[record.seq] = block
        if relinked:
            record.attached = attached
            record.superseded = attached and self._superseded(block)
            self._resort_siblings(block)
        if (moved or relinked) and parent_record is not None:
            self._refresh(parent, parent_record)
        if tier is None:
            self._set_keys(record, (None, None, None, None))
            del self._records[block], self._blocks[record.seq]
            return
        self._refresh(block, record)

    def resync(self, blocks) -> None:
        """Re-rank blocks whose conversation became active or inactive (no tier changed)."""
        for block in blocks:
            record = self._records.get(block)
            if record is not None:
                self._refresh(block, record)

    # -- internals ------------------------------------------------------------------------------------
    def _new_record(self, block: CachedBlock) -> _Record:
        record = _Record()
        for child in block.children.values():  # counted by the tier the index has recorded for them
            child_record = self._records.get(child)
            if child_record is not None:
                self._count_child(record, child_record.tier, +1)
        return record

    @staticmethod
    def _count_child(record: _Record, tier: str | None, delta: int) -> None:
        if tier == "device":
            record.device_children += delta
        elif tier == "host":
            record.host_children += delta

    def _superseded(self, block: CachedBlock) -> bool:
        return len(block.tokens) < self.block_size and is_superseded(block)  # only a partial block can be

    def _resort_siblings(self, block: CachedBlock) -> None:
        """A sibling that is a prefix of `block` is superseded while `block` is attached: re-rank it."""
        children, tokens = block.parent.children, block.tokens
        if len(children) < len(tokens):  # few siblings (the usual case): test each
            prefixes = [s for t, s in children.items() if len(t) < len(tokens) and tokens[: len(t)] == t]
        else:  # many (a root's): look up each shorter prefix
            prefixes = [s for s in map(children.get, (tokens[:n] for n in range(1, len(tokens)))) if s is not None]
        for sibling in prefixes:
            record = self._records.get(sibling)
            if record is not None and record.superseded != self._superseded(sibling):
                record.superseded = not record.superseded
                self._refresh(sibling, record)

    def _value(self, block: CachedBlock, record: _Record) -> tuple:
        return (not record.superseded, bool(self.is_active(block)), block.last_used, record.seq)

    def rank_keys(self, block: CachedBlock, record: _Record) -> tuple:
        """The keys a block should have in the device / host / disk / copies set (None: not one there)."""
        value = self._value(block, record)
        return ((record.device_children > 0,) + value if record.tier == "device" and block.ref_count == 0 else None,
                value if record.tier == "host" and record.device_children + record.host_children == 0 else None,
                value if record.tier == "disk" and not block.children else None,
                value if block.disk_copy and record.tier in ("device", "host") else None)

    def _refresh(self, block: CachedBlock, record: _Record) -> None:
        keys = self.rank_keys(block, record)
        self._set_keys(record, keys, self.weight(block) if keys[0] is not None else 0)

    def _set_keys(self, record: _Record, keys: tuple, weight: int = 0) -> None:
        self.device_weight += weight - record.weight
        record.weight = weight
        for i, (old, new) in enumerate(zip(record.keys, keys)):
            if old != new:
                if old is not None:
                    self._sets[i].remove(old)  # KeyError when absent: the record and the set disagree
                if new is not None:
                    assert new not in self._sets[i], f"eviction key added twice: {new!r}"
                    self._sets[i].add(new)
        record.keys = keys

    # -- integrity ------------------------------------------------------------------------------------
    def check(self, blocks: list[CachedBlock]) -> None:
        """Every set and counter against a full scan of `blocks`, every block the tiers cache (tests: after
        every step)."""
        assert len(self._records) == len(blocks) == len(self._blocks), f"index holds {len(self._records)} blocks"
        expected: list[set] = [set(), set(), set(), set()]
        for block in blocks:
            record = self._records.get(block)
            assert record is not None and record.tier == block.tier and record.attached, "index: stale block"
            assert self._blocks[record.seq] is block, "index: seq names another block"
            tiers = [c.tier for c in block.children.values()]
            assert (record.device_children, record.host_children) == (tiers.count("device"), tiers.count("host")), \
                "index: child counters disagree with the tree"
            assert record.superseded == is_superseded(block), "index: stale superseded flag"
            keys = self.rank_keys(block, record)
            assert record.keys == keys, f"index: stale keys {record.keys} != {keys}"
            for i, key in enumerate(keys):
                if key is not None:
                    expected[i].add(key)
        for name, keys, found in zip(_TIERS, expected, self._sets):
            assert list(found) == sorted(keys), f"index: the {name} candidates disagree with a full scan"
        unpinned = [b for b in blocks if b.on_device and b.ref_count == 0]
        assert self.num_unpinned_device == len(unpinned), "index: unpinned device count disagrees"
        assert self.device_weight == sum(map(self.weight, unpinned)), "index: device weight disagrees (checkpoints)"
