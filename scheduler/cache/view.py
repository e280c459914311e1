"""What a planner reads: the conversation cache's parts, bundled so plans need no cache object.

Planners (scheduler/cache/planner.py, room.py, host_room.py, device_pool.py) read a `CacheView` and return
a plan; they never change it (the one exception: reading a matched checkpoint that turns out unreadable
forgets it, as any reader of a bad file would). The view's parts belong to `PrefixCache`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.cache.block_mover import BlockMover
from scheduler.cache.checkpoints import Checkpoints
from scheduler.cache.eviction_index import EvictionIndex
from scheduler.cache.tiers import Tiers

if TYPE_CHECKING:
    from scheduler.memory.admission import MemoryAdmission


@dataclass(frozen=True)
class CacheView:
    """The tiers, the eviction order, the checkpoints, the memory admission's budgets and the mover's reads."""

    tiers: Tiers
    index: EvictionIndex
    ckpt: Checkpoints
    admission: "MemoryAdmission"
    mover: BlockMover
    block_size: int

    def grow_host(self, already_planned: int) -> int:
        """Host slots of the next segment a plan may commit beyond the `already_planned` growth: a whole
        segment (or what is left of the budget) when the budget and the machine allow it, else 0. The one
        home of host segment growth (a park's slot and a shrink's parks both use it)."""
        admission = self.admission
        committed = admission.host_committed_blocks + already_planned
        segment = min(admission.segment_blocks, self.tiers.host_blocks - committed)
        return segment if segment > 0 and admission.host_room_for(committed + segment) else 0
