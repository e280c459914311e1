"""The conversation cache: token-exact longest-prefix reuse over a tree of KV blocks, in two tiers.

Full blocks are shared in place; a prompt that diverges or ends inside a block reuses that block's
matching tokens by copy-on-write into a block the request owns, so a shared block is never written.
Many variants of a conversation coexist as branches (a toggling tool list hits both).

    root ── [sys prompt 0:16] ── [16:32] ── [32:48 turn 1] ── [48:57 reply tail, partial]
                                        └── [32:48 other conversation] ...

Tiers: the device pool the model computes in, and host RAM reserved at start-up. When the device needs
room, the least valuable unpinned block (a leaf of what is on the device; superseded branches first,
then least recently used) is parked in host RAM; only when the host tier is full too is the least
valuable host leaf dropped, and every drop is logged with its conversation. A hit on parked blocks
restores them. Blocks pinned by running requests never move. Nothing is decided before it is known to
succeed: `allocate` checks that room can be made before parking anything, and returns None untouched.
The moves are returned as copy lists the engine performs between steps: parks, then restores, then copies.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from engine.kv import BlockAllocator
from scheduler.cache_tree import CachedBlock, PrefixMatch, conversation_id, is_superseded, longest_match

log = logging.getLogger("strata.cache")


@dataclass
class Allocation:
    """A request's block table (shared cached blocks first, then its own) and the copies to run first."""

    block_table: list[int]
    num_shared: int
    cached_tokens: int
    reused_by_tier: dict[str, int] = field(default_factory=dict)
    parks: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device block, device block)


class PrefixCache:
    """Owns every device block id and host slot: free, cached (unpinned) or in use (pinned / owned)."""

    def __init__(self, num_blocks: int, block_size: int, enabled: bool = True, host_blocks: int = 0):
        self.enabled = enabled  # off: nothing is ever matched or kept (the reference for tests)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.host_blocks = host_blocks
        self._dev_free = BlockAllocator(num_blocks)
        self._host_free = BlockAllocator(host_blocks)
        self._root = CachedBlock((), None)
        self._on_device: dict[int, CachedBlock] = {}
        self._on_host: dict[int, CachedBlock] = {}
        self._clock = itertools.count(1)
        self._num_owned = 0  # device blocks handed to running requests, not yet in the tree
        self.stats = {"parks": 0, "restores": 0, "dropped_blocks": 0, "dropped_tokens": 0}

    # -- queries -------------------------------------------------------------------------------------
    def match(self, token_ids: list[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix, at most max_tokens long (callers pass len - 1 so the last prompt token is
        always computed). Changes nothing."""
        limit = min(len(token_ids), len(token_ids) if max_tokens is None else max_tokens)
        return longest_match(self._root, token_ids, limit if self.enabled else 0, self.block_size)

    @property
    def num_free(self) -> int:
        """Device blocks obtainable now: never-used plus unpinned cached ones (which can be moved off)."""
        return self._dev_free.num_free + sum(1 for b in self._on_device.values() if b.ref_count == 0)

    @property
    def num_cached(self) -> int:
        return len(self._on_device) + len(self._on_host)

    def usage(self) -> dict[str, int]:
        return {"device_cached": len(self._on_device), "device_in_use": self._num_owned
                + sum(1 for b in self._on_device.values() if b.ref_count), "device_total": self.num_blocks,
                "host_cached": len(self._on_host), "host_total": self.host_blocks, **self.stats}

    # -- mutations -----------------------------------------------------------------------------------
    def allocate(self, match: PrefixMatch, total_tokens: int) -> Allocation | None:
        """Pin the matched blocks (restoring parked ones) and reserve fresh blocks up to total_tokens.

        Returns None, with nothing changed, when the device cannot make room without moving pinned blocks.
        """
        fresh_count = -(-total_tokens // self.block_size) - len(match.shared)
        to_restore = [b for b in match.shared if not b.on_device]
        pinned = match.shared + ([match.cow_source] if match.cow_source is not None else [])
        for block in pinned:
            self._pin(block)
        alloc = Allocation([], len(match.shared), match.num_tokens)
        movable = sum(1 for b in self._on_device.values() if b.ref_count == 0)
        if self._dev_free.num_free + movable < fresh_count + len(to_restore):
            for block in pinned:
                self._unpin(block)
            return None
        self._make_device_room(fresh_count + len(to_restore), alloc)
        for block in to_restore:  # move back: the host slot is released once the copy is done
            block.device_id = self._dev_free.allocate(1)[0]
            alloc.restores.append((block.host_slot, block.device_id))
            self._host_free.free([block.host_slot])
            del self._on_host[block.host_slot]
            block.host_slot = -1
            self._on_device[block.device_id] = block
        fresh = self._dev_free.allocate(fresh_count)
        self._num_owned += fresh_count
        alloc.block_table = [b.device_id for b in match.shared] + fresh
        self._count_reuse(alloc, match, to_restore)
        source = match.cow_source
        if source is not None:
            if source.on_device:
                alloc.copies.append((source.device_id, fresh[0]))
            else:
                alloc.restores.append((source.host_slot, fresh[0]))
            self._unpin(source)
        self.stats["restores"] += len(alloc.restores)
        return alloc

    def release(self, token_ids: list[int], num_computed: int, allocation: Allocation) -> None:
        """A request is done: its computed tokens' blocks join the tree (unpinned), the rest are freed."""
        node = self._root
        for i, device_id in enumerate(allocation.block_table):
            start = i * self.block_size
            tokens = tuple(token_ids[start : min(start + self.block_size, num_computed)])
            if i < allocation.num_shared:
                node = self._on_device[device_id]
                self._unpin(node)
                continue
            self._num_owned -= 1
            if not tokens or not self.enabled:
                self._dev_free.free([device_id])
                continue
            node = self._insert(node, tokens, device_id)

    def check_integrity(self) -> None:
        """Per tier: free + cached (+ owned) == total; tree links consistent; pinned blocks on device."""
        self._dev_free.check_integrity()
        self._host_free.check_integrity()
        free, cached = self._dev_free.num_free, len(self._on_device)
        assert free + cached + self._num_owned == self.num_blocks, (
            f"device: free {free} + cached {cached} + in use {self._num_owned} != total {self.num_blocks}")
        assert self._host_free.num_free + len(self._on_host) == self.host_blocks, "host tier counts disagree"
        assert not any(self._dev_free._is_free[b] for b in self._on_device), "a block is both free and cached"
        for tier, index in (("device", self._on_device), ("host", self._on_host)):
            for key, block in index.items():
                assert (block.device_id if tier == "device" else block.host_slot) == key
                assert block.parent is not None and block.parent.children.get(block.tokens) is block
                assert 0 < len(block.tokens) <= self.block_size and block.ref_count >= 0
                assert not (block.ref_count and not block.on_device), "a pinned block is not on the device"
                assert len(block.tokens) == self.block_size or not block.children, "partial block has children"
        assert len({id(b) for b in self._on_device.values()} & {id(b) for b in self._on_host.values()}) == 0

    # -- internals -----------------------------------------------------------------------------------
    def _insert(self, parent: CachedBlock, tokens: tuple[int, ...], device_id: int) -> CachedBlock:
        existing = parent.children.get(tokens)
        if existing is not None and existing.on_device:  # same content already cached: keep one copy
            self._dev_free.free([device_id])
            existing.last_used = next(self._clock)
            return existing
        if existing is not None:  # parked copy of the same content: the fresh device copy replaces it
            self._host_free.free([existing.host_slot])
            del self._on_host[existing.host_slot]
            existing.host_slot = -1
            block = existing
        else:
            block = CachedBlock(tokens, parent)
            parent.children[tokens] = block
        block.device_id, block.last_used = device_id, next(self._clock)
        self._on_device[device_id] = block
        return block

    def _pin(self, block: CachedBlock) -> None:
        block.ref_count += 1
        block.last_used = next(self._clock)

    def _unpin(self, block: CachedBlock) -> None:
        assert block.ref_count > 0, "block unpinned more often than pinned"
        block.ref_count -= 1
        block.last_used = next(self._clock)

    def _make_device_room(self, count: int, alloc: Allocation) -> None:
        while self._dev_free.num_free < count:
            victim = min((b for b in self._on_device.values() if b.ref_count == 0), key=_device_victim_rank)
            slot = self._host_slot_for_park()
            del self._on_device[victim.device_id]
            if slot is None:  # no host tier, or nothing left there that may go: the data is dropped
                self._dev_free.free([victim.device_id])
                victim.device_id = -1
                self._drop(victim, "device", "device pool full and no room in the host tier")
                continue
            alloc.parks.append((victim.device_id, slot))
            self._dev_free.free([victim.device_id])
            victim.device_id, victim.host_slot = -1, slot
            self._on_host[slot] = victim
            self.stats["parks"] += 1

    def _host_slot_for_park(self) -> int | None:
        if self.host_blocks == 0:
            return None
        if self._host_free.num_free == 0:
            leaves = [b for b in self._on_host.values() if not b.children and b.ref_count == 0]
            if not leaves:
                return None
            self._drop(min(leaves, key=_device_victim_rank), "host", "host tier full")
        return self._host_free.allocate(1)[0]

    def _drop(self, block: CachedBlock, tier: str, reason: str) -> None:
        """Remove a block and everything cached after it; log what was lost."""
        conv, lost = conversation_id(block), block.subtree()
        del block.parent.children[block.tokens]
        for node in lost:
            if node.on_device:
                del self._on_device[node.device_id]
                self._dev_free.free([node.device_id])
            if node.on_host:
                del self._on_host[node.host_slot]
                self._host_free.free([node.host_slot])
        tokens = sum(len(n.tokens) for n in lost)
        self.stats["dropped_blocks"] += len(lost)
        self.stats["dropped_tokens"] += tokens
        log.info("evicted %d cached tokens of %s from the %s tier: %s", tokens, conv, tier, reason,
                 extra={"fields": {"conversation": conv, "tokens": tokens, "tier": tier, "reason": reason}})

    def _count_reuse(self, alloc: Allocation, match: PrefixMatch, restored: list[CachedBlock]) -> None:
        host = sum(len(b.tokens) for b in restored)
        if match.cow_source is not None and not match.cow_source.on_device:
            host += match.cow_tokens
        alloc.reused_by_tier = {"device": match.num_tokens - host, "host": host}


def _device_victim_rank(block: CachedBlock) -> tuple:
    # Leaves of what is on the device first (so tails leave before the heads they hang from),
    # superseded branches before live tips, then least recently used.
    has_device_child = any(c.on_device for c in block.children.values())
    return (has_device_child, not is_superseded(block), block.last_used)
