"""Room on the device: what a plan parks, drops, spills or grows, decided without changing anything.

Room on the device is made in value order: unpinned device blocks, leaves first (a tail leaves before the
head it hangs from), superseded branches before live tips, then least recently used. Each parked block
needs a host slot: a free one, else a new segment of the host tier (a "grow"), else the least valuable
host leaf goes to disk (a "spill") or, without room there, is dropped (scheduler/cache/host_room.py). The
candidates of each tier are kept in that order as blocks move (scheduler/cache/eviction_index.py); a plan
reads them with the blocks already chosen set aside (scheduler/cache/eviction_sim.py), so a parent becomes a
candidate once its last device child is chosen, exactly as if the blocks had been moved one by one, and
nothing is scanned or changed.
Hybrid models (scheduler/cache/checkpoints.py): a block's state checkpoints take slots of its tier, so a
victim frees its weight (1 + units per checkpoint) and needs as many host slots or disk files; the order is
the same. Only when the unpinned blocks cannot free enough do the checkpoints on pinned blocks go.
"""
from __future__ import annotations

from scheduler.cache.checkpoint_adopt import park_order
from scheduler.cache.eviction_sim import device_victims, movable_device_weight
from scheduler.cache.host_room import HostRoom
from scheduler.cache.plans import AllocatePlan, ExtendPlan, RoomPlan
from scheduler.cache.tree import CachedBlock
from scheduler.cache.view import CacheView


def plan_device_room(view: CacheView, plan: RoomPlan, count: int, exclude: set[CachedBlock]) -> bool:
    """Add to `plan` what frees `count` device blocks (beyond the free ones); False when it cannot.
    `exclude`: the blocks this plan pins or copies from (never moved by it). A block that carries
    checkpoints (hybrid models) frees, and needs in the host tier, their slots too."""
    short = count - view.tiers.free_slots("device") - plan.device_grow
    short -= plan_device_growth(view, plan, short)  # an elastic pool grows before anything is parked
    if short <= 0:
        return True
    short -= _drop_pinned_checkpoints(view, plan, short - movable_device_weight(view.index, exclude), exclude)
    victims = device_victims(view.index, short, exclude) if short > 0 else []
    if victims is None:
        return False
    host = HostRoom(view, plan, exclude)
    for victim in victims:
        if host.take_slots(1):
            park_with_states(view, plan, host, victim)
        else:
            plan.device_drops.append(victim)
            host.leaves.move_down(victim)
    return True


def park_with_states(view: CacheView, plan: RoomPlan, host: HostRoom, victim: CachedBlock) -> None:
    """A device victim whose block has a host slot goes there with as many of its checkpoints as the host
    tier takes, the most useful first (`park_order`); the rest are planned as checkpoint drops, the least
    useful first. Before, a block whose states did not all fit was dropped with its K/V and states.
    When the disk tier has room for the block and all its states, it goes there instead, whole: a host
    tier that holds one state (tiny qwen3next under --pressure: 7 slots, a state 5) otherwise dropped a
    conversation tip's reply-end state whenever the host had no leaf to spill for it yet."""
    order = park_order(view.ckpt, victim)
    kept = 0
    while kept < len(order) and host.take_slots(view.ckpt.units):
        kept += 1
    if kept < len(order) and host.spill_whole(victim, 1 + kept * view.ckpt.units):
        return
    left = order[kept:][::-1]
    plan.checkpoint_drops += [(victim, k) for k in left]
    host.trimmed[victim] = set(left)
    plan.parks.append(victim)
    host.leaves.park(victim)


def plan_device_growth(view: CacheView, plan: RoomPlan, short: int) -> int:
    """Add to `plan` the pool growth that covers `short` blocks, in whole segments, within the ceiling.
    Returns the blocks it adds (0: the pool is at its ceiling, or not elastic)."""
    admission = view.admission
    room = admission.device_ceiling_blocks - view.tiers.num_blocks - plan.device_grow
    if room <= 0 or short <= 0:
        return 0
    segment = admission.device_segment_blocks
    grow = min(room, -(-short // segment) * segment)
    plan.device_grow += grow
    return grow


def _drop_pinned_checkpoints(view: CacheView, plan: RoomPlan, missing: int, exclude: set[CachedBlock]) -> int:
    """When the unpinned blocks cannot free enough, the checkpoints on pinned device blocks (and on those
    this plan pins or restores: a matched checkpoint's state is read already) go, those whose loss costs
    least recompute first (`Checkpoints.gap`), then the oldest, the one the match ends at last; the blocks
    stay. Without the restored blocks' a prompt that fits the pool
    could wait forever for room its prefix's checkpoints take (nothing running would free it).
    Returns the slots freed: 0 when that is not enough either (then nothing is planned). Scans the
    checkpointed nodes, only on this last resort."""
    ckpt, units = view.ckpt, view.ckpt.units
    if missing <= 0 or not units or isinstance(plan, ExtendPlan) and plan.reserve_checkpoints:  # the states
        return 0  # a step takes inside a prompt never cost held ones (it goes on without them); its reply's end may
    allocate = plan if isinstance(plan, AllocatePlan) else None
    taken_over = allocate.match.cow_source if allocate and allocate.takeover else None  # its checkpoints go
    # anyway: counted once
    matched = allocate.match.checkpoint if allocate else None  # goes last: later prompts
    # that branch where this one did (fan-out questions over one context) need it
    restored = set(allocate.restores) if allocate else set()  # coming back to the device with all their
    # checkpoints: those may stay behind
    held = sorted(((n.last_used, k, n) for n in ckpt.nodes.values()
                   if (n.on_device and (n.ref_count or n in exclude) or n in restored) and n is not taken_over
                   for k in n.checkpoints),
                  key=lambda e: ((e[2], e[1]) == matched, ckpt.gap(e[2], e[1]), e[0], e[1]))
    count = -(-missing // units)
    if count > len(held):
        return 0
    plan.checkpoint_drops += [(n, k) for _, k, n in held[:count]]
    return count * units


