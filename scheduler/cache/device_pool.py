"""The elastic device pool: it grows when requests need room, shrinks when asked, and never drops for it.

    reserved  |=============================================|  ids the runner's pools can address
    ceiling   |===========================|                    what the admission allows now
    size      |==================|                             ids the cache hands out (cache.num_blocks)

Growth (`room.plan_device_growth`) is part of a plan that needs room: before any cached block is parked, the
pool takes another segment of ids while the size stays under the admission's ceiling. A shrink
(`plan_shrink`) vacates the ids above the target, from the top down: a cached block there moves to a free
id below the target (a device copy: it stays on the device), else is parked to host RAM (a free slot or a
new host segment; never by spilling or dropping another block). It stops at the first id it cannot vacate
(a block a running request holds, or no host room), says so in the log with the flag to raise, and the
pool keeps that size. Nothing is ever dropped to shrink: seed 002's lost 128K conversation is the reason.
Both are plans like the others (decided first, granted, then applied in one call).
"""
from __future__ import annotations

from scheduler.cache.plans import ShrinkPlan
from scheduler.cache.view import CacheView

SEGMENT_BLOCKS = 64  # the elastic pool grows by this many blocks at a time (1,024 tokens)


def plan_shrink(view: CacheView, target_blocks: int) -> ShrinkPlan:
    """The plan that brings the pool down to `target_blocks` ids, or as near as it can (plan.shrink_to).

    Hybrid models: a relocated block's checkpoints stay with it (they are named by its digest, not its id);
    a parked one takes its checkpoints' host slots along. Device checkpoints take free device slots, so
    the smaller pool must keep that many ids free: the shrink stops at the smallest size that does."""
    plan = ShrinkPlan()
    target = max(1, target_blocks)
    tiers, weight = view.tiers, view.ckpt.weight
    size = tiers.num_blocks
    free_below = sorted(b for b in tiers.free_ids("device") if b < target)
    slots = tiers.free_slots("host")  # host slots this plan can still park into
    new_size = size
    # Checkpoint room: free ids left below the new size against the device slots the checkpoints take.
    spare = tiers.free_slots("device")  # >= 0 (the integrity check)
    best = (size, 0, 0, 0, "")  # the smallest size with spare >= 0: (size, relocations, parks, host_grow, why)
    for block_id in range(size - 1, target - 1, -1):
        if tiers.is_free(block_id):
            new_size, spare = block_id, spare - 1
        else:
            block = tiers.blocks("device").get(block_id)
            if block is None or block.ref_count:
                plan.stopped_by = f"block {block_id} is in use by a running request"
                break
            if free_below:
                plan.relocations.append((block, free_below.pop(0)))
                spare -= 1  # its new id was free
            else:
                need = weight(block)
                while slots < need and (grown := _grow_host(view, plan)) > 0:
                    slots += grown
                if slots < need:
                    plan.stopped_by = "the host tier has no room to park the blocks above it (--conversation-cache-mib)"
                    break
                plan.parks.append(block)
                slots -= need
                spare += need - 1  # its checkpoints leave the device with it
            new_size = block_id
        if spare >= 0:
            best = (new_size, len(plan.relocations), len(plan.parks), plan.host_grow, "")
        elif not best[4]:
            best = best[:4] + ("the state checkpoints on the device need the free ids above it",)
    if best[0] != new_size:  # the last steps left too few free ids for the device checkpoints: undo them
        new_size, relocated, parked, plan.host_grow, plan.stopped_by = best
        del plan.relocations[relocated:], plan.parks[parked:]
    plan.shrink_to = new_size
    return plan


def _grow_host(view: CacheView, plan: ShrinkPlan) -> int:
    """Another host segment for the plan's parks, if the budget and the machine allow: its slots (or 0)."""
    segment = view.grow_host(plan.host_grow)
    plan.host_grow += segment
    return segment


def resize_pool(service, max_blocks: int) -> dict:
    """An operator's resize, served by the memory admission at its turn (memory_service.MemoryService.request):
    the ceiling from now on, and below the pool's size now a shrink to it, planned then, granted whole or
    refused. The pool does not grow back by itself: only as requests need room."""
    cache, admission = service.cache, service.admission
    ceiling = admission.set_device_ceiling(max_blocks)
    stopped_by = ""
    if ceiling < cache.num_blocks:
        grant = service.grant_plan(lambda: cache.plan_shrink(ceiling))
        stopped_by = grant.plan.stopped_by if grant.granted else "the memory admission refused the moves"
        admission.set_device_ceiling(max(ceiling, cache.num_blocks))
    return {"device_blocks": cache.num_blocks, "ceiling_blocks": admission.device_ceiling_blocks,
            "min_blocks": admission.device_min_blocks, "reserved_blocks": admission.device_reserved_blocks,
            "stopped_by": stopped_by}
