"""A holder of device memory beside the KV pool (the MoE expert cache), through the memory admission.

    holder = engine.memory.register_budget("experts")      # once, at start
    if await holder.grow(64 * 2**20): ...upload experts...  # granted whole, or refused changing nothing
    holder.give_back(64 * 2**20)                            # after freeing them; the KV pool may grow again

A grow is a queued request of the memory admission (scheduler/memory_service.py), served in arrival order
against the state at its turn. It is granted from the device budget's spare bytes when there are enough;
else the KV pool is shrunk to make the room, by the same plan as an operator's shrink (cached blocks moved
down or parked to host RAM, never dropped); a shrink that cannot reach the size needed (a running
request's block, no host room) is refused whole, so the pool and every block stay where they were. What a
holder holds lowers the pool's ceiling (MemoryAdmission.device_ceiling_blocks) until given back. The
holder allocates its own memory after a grant and frees it before give_back; the admission only counts.

The other way (`room_from_holders`): when the KV pool would park a conversation for lack of the bytes a holder
holds, the engine's grant waits while the holder's `tier` gives the fewest blocks' worth back.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.memory_service import MemoryService

log = logging.getLogger("strata.admission")
MIB = 2**20


class BudgetHolder:
    """One registered holder's device bytes (`held_bytes`); grow and give_back are its only mutations."""

    def __init__(self, name: str, service: "MemoryService"):
        self.name = name
        self._service = service
        # What the holder sizes (the expert cache's engine/backends/cuda_expert_cache_budget.ExpertBudget):
        # reclaimable_bytes() and reclaim(nbytes), asked by MemoryService.grant when the KV pool is short;
        # start() / stop() with the admission task. None: the holder never gives memory back unasked.
        self.tier = None

    @property
    def held_bytes(self) -> int:
        return self._service.admission.held_device_bytes[self.name]

    async def grow(self, nbytes: int, *, park: bool = True, on_grant=None) -> bool:
        """Hold nbytes more device memory: True once granted (the bytes are the holder's to allocate),
        False when refused (nothing changed). Queued behind earlier requests for memory. park=False: only
        spare budget and the pool's free ids (cached blocks moved down, none parked). `on_grant()` runs
        inside the grant's turn, before any later request is served (so what it sets is never stale)."""
        assert nbytes > 0, f"{self.name}: grow by a positive number of bytes (got {nbytes})"

        def serve() -> bool:
            granted = self._grant_grow(nbytes, park)
            if granted and on_grant is not None:
                on_grant()
            return granted
        return await self._service.request(serve, f"{self.name} grow")

    def grow_now(self, nbytes: int) -> bool:
        """`grow` at start-up, before the admission task runs: served at once, from spare budget only."""
        assert self._service.num_queued == 0, "grow_now is for start-up, with nothing queued"
        return self._service._serve_one(lambda: self._grant_grow(nbytes, park=False), f"{self.name} grow")

    def give_back(self, nbytes: int) -> None:
        """The holder freed nbytes: they return to the device budget (the KV pool may grow into them)."""
        held = self._service.admission.held_device_bytes
        assert 0 < nbytes <= held[self.name], f"{self.name} gives back {nbytes} bytes of {held[self.name]} held"
        held[self.name] -= nbytes
        self._service.on_change()

    def _grant_grow(self, nbytes: int, park: bool = True) -> bool:
        service = self._service
        admission, cache = service.admission, service.cache
        short = nbytes - admission.device_spare_bytes(cache.num_blocks)
        if short > 0:
            target = cache.num_blocks - -(-short // max(1, admission.block_bytes))
            if not admission.device_reserved_blocks or target < admission.device_min_blocks:
                return self._refuse(nbytes, "the KV pool cannot shrink that far (its minimum, --kv-cache-mib MIN)")
            grant = service.grant_plan(lambda: self._whole_shrink(target, park))
            if not grant.granted:
                return self._refuse(nbytes, "the KV pool could not shrink without dropping cached blocks"
                                    if park else "the KV pool has no spare room (its free ids hold cached blocks)")
        admission.held_device_bytes[self.name] += nbytes
        log.info("%s holds %d MiB of device memory more (%d MiB in all); KV pool %d blocks, ceiling %d",
                 self.name, nbytes // MIB, self.held_bytes // MIB, cache.num_blocks, admission.device_ceiling_blocks,
                 extra={"fields": {"holder": self.name, "held_bytes": self.held_bytes}})
        return True

    def _whole_shrink(self, target: int, park: bool = True):
        """The shrink plan to `target`, or None when it would stop short (granted whole or not at all), or
        would park a cached block when park is False."""
        plan = self._service.cache.plan_shrink(target)
        return plan if plan.shrink_to <= target and (park or not plan.parks) else None

    def _refuse(self, nbytes: int, why: str) -> bool:
        self._service.admission.refusals += 1
        log.warning("%s refused %d MiB of device memory: %s", self.name, nbytes // MIB, why,
                    extra={"fields": {"holder": self.name, "bytes": nbytes, "reason": why}})
        return False


def room_from_holders(service: "MemoryService", planner) -> tuple[bool, object]:
    """For an engine grant (allocate / extend): (wait, plan). When the plan would park, drop or find no room,
    but would not with bytes the holders could give back, ask them for the fewest blocks' worth that does
    and return (True, that plan), to be refused for now: the asker retries once the bytes are back. The
    fewest is found by planning with b blocks released (a what-if that changes nothing), bisected: the pool
    grows in whole segments while it has room, so planning with all the holders' bytes released would take
    them all. Else (False, the plan to grant as usual), planned once more after any what-if (a planner may
    record what it matched, e.g. request_memory's admission)."""
    admission = service.admission
    tiers = [h for h in service.holders.values() if h.tier is not None and h.tier.reclaimable_bytes() > 0]
    plan = planner()
    if not tiers or not admission.device_reserved_blocks or plan is not None and (
            plan.kind not in ("allocate", "extend") or not (plan.parks or plan.device_drops)):
        return False, plan
    block_bytes = max(1, admission.block_bytes)
    reclaimable = {h.name: h.tier.reclaimable_bytes() for h in tiers}

    def plan_with(blocks: int):
        with admission.released_for_planning(_take(reclaimable, blocks * block_bytes)):
            what_if = planner()
        return what_if if what_if is not None and not (what_if.parks or what_if.device_drops) else None

    low, high = 0, sum(reclaimable.values()) // block_bytes  # plan_with(low) is not clean
    if high == 0 or plan_with(high) is None:
        return False, planner()
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if plan_with(mid) is not None else (mid, high)
    ceiling = admission.device_ceiling_blocks
    for holder in tiers:
        take = _take(reclaimable, high * block_bytes).get(holder.name, 0)
        if take:
            holder.tier.reclaim(take)
    if admission.device_ceiling_blocks > ceiling:
        return False, planner()  # given back at once (no step in flight, no loop): plan and grant now
    return True, plan_with(high)


def _take(reclaimable: dict[str, int], nbytes: int) -> dict[str, int]:
    """nbytes from the holders in order, each at most what it can give."""
    taken = {}
    for name, can in reclaimable.items():
        taken[name] = min(can, max(0, nbytes))
        nbytes -= taken[name]
    return taken
