"""The expert cache's share of the device budget, granted by the memory admission (holder "moe_experts").

The expert cache is one of the engine's memory users: it holds device bytes through a budget holder the
memory admission registered for it (scheduler/memory/holders.py's BudgetHolder, the declared interface this
module uses and nothing else of the admission's), and `ExpertBudget` implements that module's MemoryUser
(reclaimable_bytes, reclaim, start, stop) so the admission can ask for room back.

    device budget  |=============================================|  fixed pool: its bytes + the slots';
                                                                    elastic: --kv-cache-mib MIN:MAX's MAX
    KV pool        |==================|                             blocks (grows as requests need room)
    moe_experts                        |==========|                 held: the slots' bytes (vmm: whole chunks)
    spare                                          |=============|  the KV pool grows here first

At start (`grant_at_start`) the slots --expert-cache-mib asks for (auto: every expert that fits beside the KV
pool's start) are granted from the spare budget, then made. Later, between steps:

    KV pool short   a request's allocate / extend that would park, drop or preempt (the admission's grant):
                    the admission asks `reclaim(n)`; the cache is resized down (never below `floor_slots`:
                    a decode layer's top-k run in one round) at its next step start, or at once when no step
                    is in flight; once the slots are unmapped, `give_back` returns their bytes and the request,
                    which waited (refused, retried), grows the pool into them. The KV side wins: its room holds
                    conversations, whose bytes exist nowhere else once parking fails (drops); an expert's bytes
                    are always in the pinned arena, so a smaller cache costs re-copies, never a lost token.
    spare again     every GROW_CHECK_S: below its target, missing more than GROW_MISS_RATE of its uses since the
                    last check, and no reclaim or refusal for RECLAIM_COOLDOWN_S (no ping-pong), it asks to grow
                    back: a queued request of the admission that takes spare budget and free ids of the pool
                    (cached blocks moved down, never parked) or is refused whole; the new size is set inside
                    that grant's turn, so it is never applied stale.

Invariant: held >= bytes_for(max(applied slots, requested slots)); bytes go back only after the memory behind
them is unmapped (`_on_resized`, posted to the event loop from the step's thread).
"""
from __future__ import annotations

import asyncio
import logging
import time

from engine.units import MIB

log = logging.getLogger("strata.expert_cache")
HOLDER_NAME = "moe_experts"  # never "cache": this is MoE weights, not the prompt cache
GROW_CHECK_S = 1.0
GROW_MISS_RATE = 0.05
RECLAIM_COOLDOWN_S = 10.0


class ExpertBudget:
    """Connects an ExpertCache to its budget holder (see the module docstring); the holder's MemoryUser."""

    def __init__(self, cache, holder, memory, *, target_slots: int, floor_slots: int, is_idle=lambda: False):
        self.cache, self.holder, self.memory = cache, holder, memory  # memory: the slots' SlotMemory
        holder.attach(self)  # the admission asks reclaim() when the KV pool is short
        self.target_slots = min(target_slots, cache.total_experts)
        self.floor_slots = max(1, min(floor_slots, self.target_slots))
        self.is_idle = is_idle  # no step in flight: a resize may be applied at once
        self.loop: asyncio.AbstractEventLoop | None = None
        self._timer = None
        self._growing = False
        self._last_reclaim_s = self._last_refusal_s = float("-inf")  # a refused grow waits the cooldown too
        self._seen = (0, 0)  # (hits, misses) at the last growth check
        self.num_reclaims = self.num_grow_backs = 0
        cache.on_resized, cache.budget = self._posted, self

    # -- start ---------------------------------------------------------------------------------------------
    def grant_at_start(self) -> None:
        """Hold the target's bytes (before the engine runs: served at once) and make the slots."""
        nbytes = self.memory.bytes_for(self.target_slots)
        if not self.holder.shares_elastic_pool:
            self.holder.add_fixed_budget(nbytes)  # a fixed pool: its bytes plus the slots'
        if not self.holder.grow_now(nbytes):
            figures = self.holder.budget_figures()
            raise ValueError(f"--expert-cache-mib: {self.target_slots} expert slots ({nbytes / MIB:.1f} MiB) do not "
                             f"fit beside the KV pool's {figures['pool_blocks']} blocks in the device budget "
                             f"of {figures['device_budget_bytes'] / MIB:.1f} MiB; raise --kv-cache-mib MAX or lower "
                             f"--expert-cache-mib")
        self.cache.create_slots(self.target_slots, self.memory)
        if self.cache.num_slots < self.target_slots:  # the arena stopped short: that is the size from now on
            self.target_slots = self.cache.num_slots
            self.floor_slots = min(self.floor_slots, self.target_slots)
            if nbytes > self.memory.bytes_for(self.target_slots):
                self.holder.give_back(nbytes - self.memory.bytes_for(self.target_slots))

    def start(self) -> None:
        """On the running loop: resizes report here, and the growth check runs every GROW_CHECK_S."""
        self.loop = asyncio.get_running_loop()
        self._timer = self.loop.call_later(GROW_CHECK_S, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.loop = None  # a resize after the loop ends reports on its own thread

    # -- the KV pool needs room (MemoryUser: called by the admission's grant, on the loop) -------------------
    @property
    def requested_slots(self) -> int:
        pending = self.cache.pending_slots
        return self.cache.num_slots if pending is None else pending

    def reclaimable_bytes(self) -> int:
        """Bytes held above the floor (including any already on their way back). Changes nothing."""
        return max(0, self.holder.held_bytes - self.memory.bytes_for(self.floor_slots))

    def reclaim(self, nbytes: int) -> None:
        """Have nbytes come back to the device budget (counting those already coming): the cache is asked
        to shrink to what is left, no lower than the floor; applied now when no step runs."""
        requested = self.requested_slots
        coming = self.holder.held_bytes - self.memory.bytes_for(requested)
        extra = nbytes - coming
        if extra > 0:
            keep = max(self.floor_slots, self.memory.slots_within(self.memory.bytes_for(requested) - extra))
            if keep < requested:
                self.cache.request_resize(keep)
                self.num_reclaims += 1
                self._last_reclaim_s = time.monotonic()
                log.info("expert cache (MoE weights) gives %d of %d slots back: the KV pool needs %.1f MiB",
                         requested - keep, requested, nbytes / MIB,
                         extra={"fields": {"expert_cache_slots": keep, "kv_needs_bytes": nbytes}})
        self._apply_if_idle()

    # -- growing back ---------------------------------------------------------------------------------------
    def _tick(self) -> None:
        self._timer = self.loop.call_later(GROW_CHECK_S, self._tick)
        if self.wants_to_grow():
            self.loop.create_task(self.grow_back())

    def wants_to_grow(self) -> bool:
        """Below target, missing more than GROW_MISS_RATE since the last check, no reclaim lately."""
        stats = self.cache.stats()
        hits, misses = stats["expert_cache_hits"], stats["expert_cache_misses"]
        new_hits, new_misses = hits - self._seen[0], misses - self._seen[1]
        self._seen = (hits, misses)
        missing = new_misses > GROW_MISS_RATE * (new_hits + new_misses)
        calm = time.monotonic() - max(self._last_reclaim_s, self._last_refusal_s) >= RECLAIM_COOLDOWN_S
        return missing and calm and not self._growing and self.requested_slots < self.target_slots

    async def grow_back(self) -> bool:
        """Ask the admission for the bytes up to the target (spare budget and the pool's free ids, no parks);
        True when granted. The new size is requested inside the grant's turn."""
        nbytes = self.memory.bytes_for(self.target_slots) - self.holder.held_bytes
        if nbytes <= 0 or self._growing:
            return False
        self._growing = True
        try:
            granted = await self.holder.grow(nbytes, park=False, on_grant=self._grown)
        finally:
            self._growing = False
        if granted:
            self.num_grow_backs += 1
            self._apply_if_idle()
        else:
            self._last_refusal_s = time.monotonic()
        return granted

    def _grown(self) -> None:
        """Inside the grant's turn: the slots the held bytes now cover, from the next step start."""
        self.cache.request_resize(min(self.target_slots, self.memory.slots_within(self.holder.held_bytes)))

    # -- a resize applied (on a step's thread, or here) -------------------------------------------------------
    def _apply_if_idle(self) -> None:
        if self.cache.pending_slots is not None and self.is_idle():
            self.cache.at_step_start()  # no step in flight: the streams are idle, this is between steps

    def _posted(self, num_slots: int) -> None:
        if self.loop is None:  # before the loop runs (start-up, tools): on the caller's thread
            self._on_resized(num_slots)
        else:
            self.loop.call_soon_threadsafe(self._on_resized, num_slots)

    def _on_resized(self, num_slots: int) -> None:
        """Give back what is held beyond the slots mapped now and those still requested."""
        excess = self.holder.held_bytes - self.memory.bytes_for(max(self.cache.num_slots, self.requested_slots))
        if excess > 0:
            self.holder.give_back(excess)
            log.info("expert cache (MoE weights): %d slots, %.1f MiB of device memory given back to the KV pool",
                     self.cache.num_slots, excess / MIB,
                     extra={"fields": {"expert_cache_slots": self.cache.num_slots, "given_back_bytes": excess}})


def connect_expert_budget(cache, holder, top_k: int, is_idle=lambda: False) -> ExpertBudget:
    """The server's expert cache under the memory admission, through `holder` (registered as HOLDER_NAME),
    its slots made now (before the first step):

        elastic KV pool   slots mapped outside the arena (VmmSlotMemory), in the pool's MAX: N MiB, or auto =
                          every expert that fits beside the pool's starting size (the pool takes it back as
                          requests need room)
        fixed KV pool     slots in the arena after the pool (ArenaSlotMemory): N MiB, or auto = what the
                          arena has left less AUTO_HEADROOM_BYTES; nothing moves between the two
    The floor is top_k slots (a decode token's experts of one layer in one round); `is_idle()` says no step
    is in flight (a resize may then be applied at once)."""
    from engine.backends.cuda.expert_cache.cache import AUTO_HEADROOM_BYTES
    from engine.backends.cuda.expert_cache.memory import ArenaSlotMemory, VmmSlotMemory

    if holder.shares_elastic_pool:
        memory = VmmSlotMemory(cache.device, cache.slot_bytes, cache.total_experts)
        spare = holder.spare_bytes()
        target = cache.wanted_slots(0) if cache.budget_mib != "auto" else max(1, memory.slots_within(spare))
    else:
        memory = ArenaSlotMemory(cache.device, cache.slot_bytes)
        target = cache.wanted_slots(cache.device.arena.largest_free - AUTO_HEADROOM_BYTES)
    budget = ExpertBudget(cache, holder, memory, target_slots=target, floor_slots=top_k, is_idle=is_idle)
    budget.grant_at_start()
    figures = holder.budget_figures()
    pool_bytes, block_bytes = figures["pool_blocks"] * figures["block_bytes"], figures["block_bytes"]
    log.info("device budget %.1f MiB: KV pool %.1f MiB (ceiling %.1f MiB), expert cache (MoE weights, not the prompt "
             "cache) %.1f MiB held by %s: %d slots, floor %d, %s", figures["device_budget_bytes"] / MIB,
             pool_bytes / MIB, max(figures["pool_blocks"], figures["ceiling_blocks"]) * block_bytes / MIB,
             holder.held_bytes / MIB, holder.name, cache.num_slots, budget.floor_slots,
             "shared with the elastic KV pool" if holder.shares_elastic_pool else "beside the fixed KV pool",
             extra={"fields": {"device_budget_bytes": figures["device_budget_bytes"],
                               "expert_cache_held_bytes": holder.held_bytes}})
    return budget
