"""Holders of device memory beside the KV pool (the MoE expert cache), through the memory admission.

The engine's memory users plug in here, through two declared interfaces: the user implements `MemoryUser`
(how much it could give back, and giving it back), and gets a `BudgetHolder` from the service:

    holder = engine.memory.register_budget("moe_experts")  # once, at start (memory/service.py)
    holder.attach(user)                                     # the MemoryUser the admission may ask for room
    if await holder.grow(64 * MIB): ...upload experts...    # granted whole, or refused changing nothing
    holder.give_back(64 * MIB)                              # after freeing them; the KV pool may grow again

A grow is a queued request of the memory admission (memory/service.py), served in arrival order against the
state at its turn. It is granted from the device budget's spare bytes when there are enough; else the KV
pool is shrunk to make the room, by the same plan as an operator's shrink (cached blocks moved down or
parked to host RAM, never dropped); a shrink that cannot reach the size needed (a running request's block,
no host room) is refused whole, so the pool and every block stay where they were. What a holder holds
lowers the pool's ceiling (MemoryAdmission.device_ceiling_blocks) until given back. The user allocates its
own memory after a grant and frees it before give_back; the admission only counts.

The other way (`room_from_holders`): when the KV pool would park a conversation for lack of the bytes a holder
holds, the engine's grant waits while the holder's user gives the fewest blocks' worth back.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

from engine.units import MIB
from scheduler.memory.admission import MemoryAdmission

log = logging.getLogger("strata.admission")


class MemoryUser(Protocol):
    """What an engine part holding device memory through a BudgetHolder implements (the expert cache's:
    engine/backends/cuda/expert_cache/budget.py's ExpertBudget). Called on the event loop."""

    def reclaimable_bytes(self) -> int:
        """Bytes it could give back now (held above its floor, counting those on their way). Changes nothing."""

    def reclaim(self, nbytes: int) -> None:
        """Give nbytes back in all (counting those already coming), now or after the step in flight, each
        through BudgetHolder.give_back once the memory behind them is freed."""

    def start(self) -> None:
        """The admission task started on the running loop (timers may begin)."""

    def stop(self) -> None:
        """The admission task stops: nothing more will be asked."""


class HolderService(Protocol):
    """What a holder asks of the MemoryService that registered it (memory/service.py imports this module,
    so the service is declared here by what it offers rather than imported)."""

    admission: MemoryAdmission
    cache: Any  # the PrefixCache whose device pool shrinks to make a holder's room
    num_queued: int

    def on_change(self) -> None: ...

    async def request(self, serve: Callable[[], Any], name: str) -> Any: ...

    def serve_now(self, serve: Callable[[], Any], name: str) -> Any: ...

    def grant_plan(self, planner: Callable[[], Any]) -> Any: ...


class BudgetHolder:
    """One registered holder's device bytes (`held_bytes`); grow and give_back are its only mutations."""

    def __init__(self, name: str, service: HolderService):
        self.name = name
        self._service = service
        # Asked for room back by MemoryService.grant when the KV pool is short, started and stopped with the
        # admission task (attach). None: the holder never gives memory back unasked.
        self.user: MemoryUser | None = None

    def attach(self, user: MemoryUser) -> None:
        """The memory user behind this holder, from now on asked for room when the KV pool is short."""
        self.user = user

    @property
    def held_bytes(self) -> int:
        """Device bytes this holder holds now (granted, not yet given back)."""
        return self._service.admission.held_device_bytes[self.name]

    # -- the device budget as a user sizes itself against it (reads; change nothing) ---------------------
    @property
    def shares_elastic_pool(self) -> bool:
        """Whether the KV pool is elastic, its reserve the device budget this holder shares (else a fixed
        pool: the holder's bytes come beside it, through add_fixed_budget)."""
        return bool(self._service.admission.device_reserved_blocks)

    def spare_bytes(self) -> int:
        """Device budget neither the KV pool (as it is now) nor any holder holds."""
        return self._service.admission.device_spare_bytes(self._service.cache.num_blocks)

    def budget_figures(self) -> dict[str, int]:
        """The device budget, the KV pool's blocks, block bytes and ceiling, for a user's log lines."""
        admission = self._service.admission
        return {"device_budget_bytes": admission.device_budget_bytes, "pool_blocks": self._service.cache.num_blocks,
                "block_bytes": admission.block_bytes, "ceiling_blocks": admission.device_ceiling_blocks}

    def add_fixed_budget(self, nbytes: int) -> None:
        """Beside a fixed KV pool, the holder's bytes join the device budget (counted once: the pool never
        grows into them). Mutates the budget; before the first grow."""
        self._service.admission.add_device_budget(nbytes)

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
        return self._service.serve_now(lambda: self._grant_grow(nbytes, park=False), f"{self.name} grow")

    def give_back(self, nbytes: int) -> None:
        """The holder freed nbytes: they return to the device budget (the KV pool may grow into them)."""
        self._service.admission.release_held(self.name, nbytes)
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
        admission.hold(self.name, nbytes)
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
        self._service.admission.count_refusal()
        log.warning("%s refused %d MiB of device memory: %s", self.name, nbytes // MIB, why,
                    extra={"fields": {"holder": self.name, "bytes": nbytes, "reason": why}})
        return False


def room_from_holders(admission: MemoryAdmission, holders, planner) -> tuple[bool, object]:
    """For an engine grant (allocate / extend): (wait, plan). When the plan would park, drop or find no room,
    but would not with bytes the holders could give back, ask them for the fewest blocks' worth that does
    and return (True, that plan), to be refused for now: the asker retries once the bytes are back. The
    fewest is found by planning with b blocks released (a what-if that changes nothing), bisected: the pool
    grows in whole segments while it has room, so planning with all the holders' bytes released would take
    them all. Else (False, the plan to grant as usual), planned once more after any what-if (a planner may
    record what it matched, e.g. memory/requests.py's admission)."""
    users = [h for h in holders if h.user is not None and h.user.reclaimable_bytes() > 0]
    plan = planner()
    if not users or not admission.device_reserved_blocks or plan is not None and (
            plan.kind not in ("allocate", "extend") or not (plan.parks or plan.device_drops)):
        return False, plan
    block_bytes = max(1, admission.block_bytes)
    reclaimable = {h.name: h.user.reclaimable_bytes() for h in users}

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
    for holder in users:
        take = _take(reclaimable, high * block_bytes).get(holder.name, 0)
        if take:
            holder.user.reclaim(take)
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
