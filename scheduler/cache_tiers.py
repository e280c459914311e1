"""How the conversation cache moves blocks down its tiers under pressure: device -> host RAM -> disk,
and what it drops (and says) when no lower tier can take them.

A mixin of PrefixCache (prefix_cache.py), split out to keep each file about one concern: prefix_cache.py
holds matching, allocation, release and the invariants; this file the eviction policy and its reporting.
"""
from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from scheduler.cache_tree import CachedBlock, conversation_id, is_superseded

if TYPE_CHECKING:
    from scheduler.prefix_cache import Allocation

log = logging.getLogger("strata.cache")


class TierMoves:
    """Eviction, parking, spilling and dropping; uses PrefixCache's state (see its __init__)."""

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
            self.mover.park(victim.device_id, slot)
            self._dev_free.free([victim.device_id])
            victim.device_id, victim.host_slot = -1, slot
            self._on_host[slot] = victim
            self.stats["parks"] += 1

    def _host_slot_for_park(self) -> int | None:
        if self.host_blocks == 0:
            return None
        if self._host_free.num_free == 0:
            self._grow_host()
        if self._host_free.num_free == 0:
            leaves = [b for b in self._on_host.values()
                      if b.ref_count == 0 and not any(c.on_device or c.on_host for c in b.children.values())]
            if not leaves:
                return None
            victim = min(leaves, key=_device_victim_rank)
            if not self._spill(victim):
                self._drop(victim, "host", "host tier full" + (" and the disk write failed" if self.disk_blocks
                                                               else " (no disk tier)"))
        return self._host_free.allocate(1)[0]

    def _grow_host(self) -> None:
        """Commit another segment of the host tier when the admission grants it (else the tier is full)."""
        blocks = self.admission.next_host_segment()
        if blocks and self.admission.grant_host_growth(blocks):
            self.mover.grow_host(self.admission.host_committed_blocks)
            self._host_free.grow(blocks)

    def _spill(self, block: CachedBlock) -> bool:
        """Move a host block to the disk tier (dropping the least valuable disk leaf when it is full)."""
        if self.disk_blocks == 0:
            return False
        if len(self._on_disk) >= self.disk_blocks:
            leaves = [b for b in self._on_disk.values() if not b.children]
            if not leaves:
                return False
            self._drop(min(leaves, key=_device_victim_rank), "disk", "disk tier full")
        if not self.mover.save(block):
            return False
        self._host_free.free([block.host_slot])
        del self._on_host[block.host_slot]
        block.host_slot, block.on_disk = -1, True
        self._on_disk[block.digest] = block
        self.stats["spills"] += 1
        return True

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
            if node.on_disk:
                del self._on_disk[node.digest]
                self.mover.delete_disk(node)
        tokens = sum(len(n.tokens) for n in lost)
        self._report_full(tier, len(lost))
        now = time.time()
        for node in lost:  # remembered by digest only, so a later miss can say which eviction caused it
            self._dropped[node.digest] = (now, tier, reason)
        while len(self._dropped) > _DROPPED_HISTORY:
            self._dropped.popitem(last=False)
        self.stats["dropped_blocks"] += len(lost)
        self.stats["dropped_tokens"] += tokens
        log.info("evicted %d cached tokens of %s from the %s tier: %s", tokens, conv, tier, reason,
                 extra={"fields": {"conversation": conv, "tokens": tokens, "tier": tier, "reason": reason}})

    def _report_full(self, tier: str, dropped_blocks: int) -> None:
        """Say once per episode that a budget is full, with the setting that would have kept everything."""
        first = tier not in self._full_episode
        self._full_episode[tier] = self._full_episode.get(tier, 0) + dropped_blocks
        if not first:
            return
        flag, total = {"device": ("--kv-cache-mib", self.num_blocks), "host": ("--conversation-cache-mib",
                       self.host_blocks), "disk": ("--conversation-cache-disk-mib", self.disk_blocks)}[tier]
        need_mib = max(1, math.ceil((total + dropped_blocks) * self.block_bytes / 2**20))
        log.warning("the %s tier of the conversation cache is full (%d blocks): cached conversations are being "
                    "dropped; %s %.0f or more would have kept them (the figure grows as long as this lasts)",
                    tier, total, flag, need_mib, extra={"fields": {"tier": tier, "blocks": total, "flag": flag}})

    def _end_full_episodes(self) -> None:
        free = {"device": self._dev_free.num_free / max(1, self.num_blocks),
                "host": self._host_free.num_free / max(1, self.host_blocks),
                "disk": 1 - len(self._on_disk) / max(1, self.disk_blocks)}
        for tier in [t for t in self._full_episode if free[t] > 0.1]:
            log.info("the %s tier has room again after dropping %d blocks", tier, self._full_episode.pop(tier))


_DROPPED_HISTORY = 65536  # digests of dropped blocks kept for explaining misses (16 bytes each)


def _device_victim_rank(block: CachedBlock) -> tuple:
    # Leaves of what is on the device first (so tails leave before the heads they hang from),
    # superseded branches before live tips, then least recently used.
    has_device_child = any(c.on_device for c in block.children.values())
    return (has_device_child, not is_superseded(block), block.last_used)
