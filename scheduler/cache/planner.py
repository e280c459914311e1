"""The planner: reads the cache (a `CacheView`) and returns a typed plan per kind, changing nothing.

`PrefixCache.plan_allocate` / `plan_extend` / `plan_shrink` / `plan_release` ask it; the memory admission
grants or refuses the plan whole (scheduler/memory/admission.py); only a granted plan is applied
(`PrefixCache.apply`). Room on the device is planned by scheduler/cache/room.py, the elastic pool's shrink
by scheduler/cache/device_pool.py.
"""
from __future__ import annotations

from engine.kv import blocks_needed
from scheduler.cache.device_pool import plan_shrink
from scheduler.cache.plans import AllocatePlan, Allocation, ExtendPlan, ReleasePlan, ShrinkPlan
from scheduler.cache.room import plan_device_room
from scheduler.cache.tree import CachedBlock, PrefixMatch
from scheduler.cache.view import CacheView


class Planner:
    """Plans over one cache's view. Methods return a plan, or None where the device has no room."""

    def __init__(self, view: CacheView):
        self.view = view

    def allocate(self, match: PrefixMatch, num_tokens: int, checkpoints: int = 0) -> AllocatePlan | None:
        """Pin the matched blocks (restoring parked ones) and fresh blocks up to num_tokens. None when the
        device cannot make room without moving pinned blocks. `checkpoints`: how many the request will take
        (hybrid models), each a device slot reserved from now on. Reads the matched disk blocks' bytes."""
        view, ckpt = self.view, self.view.ckpt
        match, payloads, unreadable = self._read_disk_blocks(match)
        if unreadable:  # shortened: back to a checkpoint (or a state window) in what is left
            match = ckpt.trim(match)
        match, state = ckpt.read_matched(match)
        fresh = blocks_needed(num_tokens, view.block_size) - len(match.shared)
        restores = [b for b in match.shared if not b.on_device]
        loads = {id(b): ckpt.read_disk(b) for b in restores if not b.on_host and b.checkpoints}
        fields = dict(match=match, payloads=payloads, unreadable=unreadable, restores=restores,
                      reserve_checkpoints=checkpoints, checkpoint_state=state, checkpoint_loads=loads)
        plan = AllocatePlan(fresh=fresh, **fields)
        keep = set(match.shared) | ({match.cow_source} if match.cow_source else set())
        room = fresh + sum(ckpt.weight(b) for b in restores) + checkpoints * ckpt.units
        if plan_device_room(view, plan, room, keep):
            return plan
        source = match.cow_source
        if source is None or not source.on_device:
            return None
        # The copy source occupies a block this request needs: take it over when nobody else can want it
        # (unpinned leaf), else give up its few tokens rather than wait forever.
        plan = AllocatePlan(fresh=fresh - 1, takeover=True, **fields)
        if source.ref_count == 0 and not source.children:
            room -= 1 + ckpt.units * len(source.checkpoints)  # its own checkpoints go with the takeover
            return plan if plan_device_room(view, plan, room, keep) else None
        return self.allocate(ckpt.trim(PrefixMatch(match.shared, None, 0, match.salt, match.conversation)),
                             num_tokens, checkpoints)

    def extend(self, allocation: Allocation, num_tokens: int, checkpoints: int = 0) -> ExtendPlan | None:
        """Fresh blocks so a running request's table holds num_tokens (its next step), and a device slot
        for each checkpoint that step will take (hybrid models). None: no room."""
        fresh = max(0, blocks_needed(num_tokens, self.view.block_size) - len(allocation.block_table))
        plan = ExtendPlan(fresh=fresh, allocation=allocation, reserve_checkpoints=checkpoints)
        room = plan.fresh + checkpoints * self.view.ckpt.units
        return plan if plan_device_room(self.view, plan, room, set()) else None

    def shrink(self, num_blocks: int) -> ShrinkPlan:
        """Bring the device pool down to num_blocks (or as near as it can without dropping anything)."""
        return plan_shrink(self.view, num_blocks)

    @staticmethod
    def release(token_ids: list[int], num_computed: int, allocation: Allocation, preempt: bool = False,
                final_state=None) -> ReleasePlan:
        """A request is done (or preempted): its computed tokens' blocks join the tree, unpinned, with the
        checkpoints it took and (hybrid models) `final_state`, its state after num_computed tokens."""
        return ReleasePlan(allocation=allocation, token_ids=list(token_ids), num_computed=num_computed,
                           final_state=final_state, preempt=preempt)

    def _read_disk_blocks(self, match: PrefixMatch) -> tuple[PrefixMatch, dict, list[CachedBlock]]:
        """Bytes of the matched blocks that live only on disk, read first so an unreadable file only
        shortens the match: (the match as far as it is readable, id(block) -> payload, unreadable blocks)."""
        payloads: dict[int, object] = {}
        mover = self.view.mover
        for i, block in enumerate(match.shared):
            if block.on_device or block.on_host:
                continue
            payload = mover.read_disk(block)
            if payload is None:
                return PrefixMatch(match.shared[:i], None, 0, match.salt, match.conversation), payloads, [block]
            payloads[id(block)] = payload
        source = match.cow_source
        if source is not None and not (source.on_device or source.on_host):
            payload = mover.read_disk(source)
            if payload is None:
                return PrefixMatch(match.shared, None, 0, match.salt, match.conversation), payloads, [source]
            payloads[id(source)] = payload
        return match, payloads, []
