"""A holder of device memory beside the KV pool (the MoE expert cache, later), through the memory admission.

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

    @property
    def held_bytes(self) -> int:
        return self._service.admission.held_device_bytes[self.name]

    async def grow(self, nbytes: int) -> bool:
        """Hold nbytes more device memory: True once granted (the bytes are the holder's to allocate),
        False when refused (nothing changed). Queued behind earlier requests for memory."""
        assert nbytes > 0, f"{self.name}: grow by a positive number of bytes (got {nbytes})"
        return await self._service.request(lambda: self._grant_grow(nbytes), f"{self.name} grow")

    def give_back(self, nbytes: int) -> None:
        """The holder freed nbytes: they return to the device budget (the KV pool may grow into them)."""
        held = self._service.admission.held_device_bytes
        assert 0 < nbytes <= held[self.name], f"{self.name} gives back {nbytes} bytes of {held[self.name]} held"
        held[self.name] -= nbytes
        self._service.on_change()

    def _grant_grow(self, nbytes: int) -> bool:
        service = self._service
        admission, cache = service.admission, service.cache
        short = nbytes - admission.device_spare_bytes(cache.num_blocks)
        if short > 0:
            target = cache.num_blocks - -(-short // max(1, admission.block_bytes))
            if not admission.device_reserved_blocks or target < admission.device_min_blocks:
                return self._refuse(nbytes, "the KV pool cannot shrink that far (its minimum, --kv-cache-mib MIN)")
            grant = service.grant_plan(lambda: self._whole_shrink(target))
            if not grant.granted:
                return self._refuse(nbytes, "the KV pool could not shrink without dropping cached blocks")
        admission.held_device_bytes[self.name] += nbytes
        log.info("%s holds %d MiB of device memory more (%d MiB in all); KV pool %d blocks, ceiling %d",
                 self.name, nbytes // MIB, self.held_bytes // MIB, cache.num_blocks, admission.device_ceiling_blocks,
                 extra={"fields": {"holder": self.name, "held_bytes": self.held_bytes}})
        return True

    def _whole_shrink(self, target: int):
        """The shrink plan to `target`, or None when it would stop short (granted whole or not at all)."""
        plan = self._service.cache.plan_shrink(target)
        return plan if plan.shrink_to <= target else None

    def _refuse(self, nbytes: int, why: str) -> bool:
        self._service.admission.refusals += 1
        log.warning("%s refused %d MiB of device memory: %s", self.name, nbytes // MIB, why,
                    extra={"fields": {"holder": self.name, "bytes": nbytes, "reason": why}})
        return False
