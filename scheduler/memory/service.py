"""The memory admission as one coroutine on the event loop: every request for memory, served in arrival order.

    engine step path    grant(planner)              served at once, after every request queued ahead of it
    operators, holders  await request(serve, name)  queued; the admission task serves it at its turn

A request carries a *planner*, never a plan: the plan is computed when the request is served, against the
state of that moment, then granted or refused whole (MemoryAdmission.grant) and applied (one call on the
runner), with no await in between. A plan is therefore never applied to a state it was not computed from;
a request that waited in the queue (across awaits, while steps moved blocks) plans only when its turn
comes. The engine's own plans (allocate / extend / release, between steps) take the same path without
an extra loop tick: with nothing queued, `grant` is plan + grant + apply inline; with something queued,
those requests are served first, inline, so arrival order holds either way. A refused plan leaves every
block where it was (nothing was touched to make it).

Other budget holders (the MoE expert cache) take device memory through `register_budget` (memory/holders.py):
their grows are queued requests like an operator's shrink; what they hold lowers the KV pool's ceiling, and an
engine grant that would park for lack of it waits while they give some back (holders.room_from_holders).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

from scheduler.memory.holders import BudgetHolder, room_from_holders
from scheduler.cache.plans import Plan

log = logging.getLogger("strata.admission")


@dataclass
class Grant:
    """What serving one planner came to. `plan` None: no plan could be made (no room; nothing changed)."""

    plan: Plan | None
    granted: bool = False
    allocation: Any = None  # the applied plan's Allocation (allocate / extend / release); None for a shrink


class MemoryService:
    """Serves requests for memory one at a time on the event loop: the engine's inline, the others queued."""

    def __init__(self, cache, on_change: Callable[[], None] = lambda: None):
        self.cache = cache
        self.admission = cache.admission
        self.on_change = on_change  # after a queued request is served: the engine may admit again
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._serving = False
        self.num_served = 0  # requests served from the queue (by the task or inline ahead of a grant)
        self.holders: dict[str, BudgetHolder] = {}
        self.num_waits_for_holders = 0  # engine grants refused while a holder gives room back

    def start(self) -> None:
        """Start the admission task on the running loop."""
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="strata-memory-admission")
        for holder in self.holders.values():
            if holder.user is not None:
                holder.user.start()

    async def close(self) -> None:
        """Serve what is queued, then stop the task; later requests are served at once, as without a loop."""
        self.serve_queued()
        self._queue = None
        for holder in self.holders.values():
            if holder.user is not None:
                holder.user.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    @property
    def num_queued(self) -> int:
        """Requests for memory waiting for their turn (0 without a running admission task)."""
        return self._queue.qsize() if self._queue is not None else 0

    # -- the engine's path (synchronous, between steps) ----------------------------------------------
    def grant(self, planner: Callable[[], Plan | None]) -> Grant:
        """Serve what is queued ahead, then plan now, grant or refuse the plan whole, and apply it if
        granted. Mutates the cache only on a grant. Never awaits. A plan that would park, drop or find no
        room while a budget holder could give the pool that room is refused for now instead (the holder
        shrinks, gives back, and the asker's retry grows the pool: holders.room_from_holders)."""
        if self._queue is not None and not self._queue.empty():
            self.serve_queued()
        waiting, plan = room_from_holders(self.admission, self.holders.values(), planner)
        if waiting:
            self.num_waits_for_holders += 1
            return Grant(plan)
        return self._grant_apply(plan)

    def grant_plan(self, planner: Callable[[], Plan | None]) -> Grant:
        """For a queued request's `serve`: plan, grant, apply, at its turn (no queue drained: it is the turn)."""
        assert self._serving, "grant_plan is for a request being served; the engine calls grant"
        return self._plan_grant_apply(planner)

    def _plan_grant_apply(self, planner) -> Grant:
        return self._grant_apply(planner())

    def _grant_apply(self, plan: Plan | None) -> Grant:
        if plan is None:
            return Grant(None)
        if not self.admission.grant(plan):
            self.cache.stats["refused_plans"] += 1
            return Grant(plan)
        return Grant(plan, True, self.cache.apply(plan))

    # -- queued requests (operators, other budget holders) -------------------------------------------
    async def request(self, serve: Callable[[], Any], name: str) -> Any:
        """Queue `serve` (it plans, and grants through grant_plan, only when called) and return its result
        once the admission task (or a grant ahead of which it was queued) has run it."""
        if self._queue is None:  # no loop task (tools, tests without start): served at once
            return self.serve_now(serve, name)
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((serve, name, future))
        return await future

    def serve_queued(self) -> int:
        """Serve every queued request now, in arrival order. Returns how many."""
        count = 0
        while self._queue is not None and not self._queue.empty():
            self._serve_item(self._queue.get_nowait())
            count += 1
        return count

    async def _run(self) -> None:
        while True:
            item = await self._queue.get()
            self._serve_item(item)

    def _serve_item(self, item) -> None:
        serve, name, future = item
        if future.cancelled():  # the asker went away: nothing was planned for it
            return
        try:
            result = self.serve_now(serve, name)
        except Exception as exc:  # a failing request fails its asker, never the admission
            log.error("memory request %s failed: %s", name, exc, extra={"fields": {"request": name}})
            future.set_exception(exc)
        else:
            future.set_result(result)
        self.on_change()

    def serve_now(self, serve: Callable[[], Any], name: str) -> Any:
        """Serve one request at once, outside the queue: for start-up (a holder's first grow, nothing queued
        yet) and for the queue itself. Never inside another request's serve."""
        assert not self._serving, f"memory request {name} served inside another: plans would interleave"
        self._serving = True
        try:
            self.num_served += 1
            return serve()
        finally:
            self._serving = False

    @property
    def device_reachable_blocks(self) -> int:
        """Where the pool could grow to with what the holders can give back (above their floors): the
        ceiling a request waits for before it is planned at all. Changes nothing."""
        give = {h.name: h.user.reclaimable_bytes() for h in self.holders.values() if h.user is not None}
        with self.admission.released_for_planning(give):
            return self.admission.device_ceiling_blocks

    # -- other budget holders ------------------------------------------------------------------------
    def register_budget(self, name: str, tier: str = "device") -> BudgetHolder:
        """The one way an engine part holds memory beside the KV pool (the MoE expert cache): a holder of
        `tier` memory, which asks for bytes with `await holder.grow(n)` (granted whole, by shrinking the KV
        pool when the budget is short: parks, never drops), gives them back with `holder.give_back(n)`, and
        plugs its MemoryUser in with `holder.attach(user)`. Only the device tier for now."""
        if tier != "device":
            raise ValueError(f"budget holders take device memory only for now (got tier {tier!r})")
        if name in self.holders or name == "kv":
            raise ValueError(f"a budget holder named {name!r} is registered already")
        holder = BudgetHolder(name, self)
        self.holders[name] = holder
        self.admission.add_holder(name)
        return holder
