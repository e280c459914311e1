"""Host slots as one plan consumes them: free ones, then granted growth, then evicted leaves.

A device victim parked by a plan (scheduler/cache/room.py) takes a host slot: a free committed one, else a new
segment of the host tier (`CacheView.grow_host`), else the least valuable host leaf goes to disk (a spill) or,
without room there, is dropped. Disk room comes from a written-behind copy first, then a disk leaf. Read
off the eviction index with this plan's choices set aside (scheduler/cache/eviction_sim.py); changes nothing.
"""
from __future__ import annotations

from scheduler.cache.eviction_sim import HostLeaves
from scheduler.cache.plans import AllocatePlan, RoomPlan
from scheduler.cache.tree import CachedBlock
from scheduler.cache.view import CacheView


class HostRoom:
    """Host slots as the plan consumes them: free ones, then granted growth, then evicted leaves."""

    def __init__(self, view: CacheView, plan: RoomPlan, exclude: set[CachedBlock]):
        self.view, self.plan = view, plan
        self.leaves = HostLeaves(view.index, exclude)  # exclude: the blocks being restored
        self.trimmed: dict[CachedBlock, set[int]] = {}  # parked victims' checkpoints this plan drops
        # Slots the plan's own restores give back count as free: a restore and a park may swap a slot
        # (the runner reads such a restore's bytes before the park overwrites them).
        restores = plan.restores if isinstance(plan, AllocatePlan) else []
        self.free = view.tiers.free_slots("host") + sum(self.weight(b) for b in restores if b.on_host)
        self.disk_room = view.tiers.free_slots("disk")

    def weight(self, block: CachedBlock) -> int:
        """Slots a block takes in a tier: 1, plus its checkpoints' (less those this plan drops)."""
        return self.view.ckpt.weight(block) - self.view.ckpt.units * len(self.trimmed.get(block, ()))

    def take_slots(self, count: int) -> bool:
        """`count` host slots (a block and its checkpoints); on False some may be spent: the plan then
        uses fewer host slots than it could, never more than there are."""
        return all(self.take_slot() for _ in range(count))

    def take_slot(self) -> bool:
        if self.view.tiers.host_blocks == 0:
            return False
        if self.free <= 0:
            segment = self.view.grow_host(self.plan.host_grow)
            self.plan.host_grow += segment
            self.free += segment
        while self.free <= 0:
            if not self._evict_host_leaf():
                return False
        self.free -= 1
        return True

    def _evict_host_leaf(self) -> bool:
        """Free slots: the least valuable host leaf (blocks parked earlier in this plan included) goes to
        disk, or is dropped without room there. A block parked in this plan then skips the host tier."""
        plan = self.plan
        victim = self.leaves.take_host_leaf()
        if victim is None:
            return False
        has_file = victim.disk_copy and victim not in plan.copy_drops  # a copy this plan deleted needs room again
        need = self.weight(victim) - (self._copy_slots(victim) if has_file else 0)  # written behind: only
        # the checkpoints without a file need room
        if has_file:
            self.leaves.leaving(victim)  # its own file is not one to delete for the room
        while self.disk_room < need and self.view.tiers.disk_blocks and self._make_disk_room():
            pass
        if victim in self.leaves.parked:
            plan.parks.remove(victim)
        if self.disk_room >= need:
            plan.spills.append(victim)
            self.disk_room -= need
        else:
            plan.host_drops.append(victim)  # from the device when this plan had parked it: no wasted copy
        self.leaves.move_down(victim)
        self.free += self.weight(victim)
        return True

    def spill_whole(self, victim: CachedBlock, taken: int) -> bool:
        """A device victim whose states do not all fit the host tier goes straight to disk with all of
        them, when the disk has (or can make) room: the `taken` host slots it got are given back. False
        (nothing changed) without a disk tier or room there."""
        has_file = victim.disk_copy and victim not in self.plan.copy_drops
        need = self.weight(victim) - (self._copy_slots(victim) if has_file else 0)
        if not self.view.tiers.disk_blocks:
            return False
        if has_file:
            self.leaves.leaving(victim)
        while self.disk_room < need and self._make_disk_room():
            pass
        if self.disk_room < need:
            return False
        self.disk_room -= need
        self.free += taken
        self.plan.spills.append(victim)
        self.leaves.move_down(victim)
        return True

    def _make_disk_room(self) -> bool:
        """Room for files: a written-behind copy goes first (its block stays resident; its checkpoints'
        copies go with it), else a disk leaf (with its checkpoint files). False when neither is left."""
        copy = self.leaves.take_disk_copy()
        if copy is not None:
            self.plan.copy_drops.append(copy)
            self.disk_room += self._copy_slots(copy)
            return True
        dropped = self.leaves.take_disk_leaf()
        if dropped is not None:
            self.plan.disk_drops.append(dropped)
            self.disk_room += self.weight(dropped)
            return True
        return False

    def _copy_slots(self, block: CachedBlock) -> int:
        """Disk slots the written-behind files of a resident block take: its own and its checkpoints'."""
        ckpt, trimmed = self.view.ckpt, self.trimmed.get(block, ())
        return 1 + ckpt.units * sum((block.digest, k) in ckpt.store.copies for k in block.checkpoints
                                    if k not in trimmed)
