"""The eviction choice as it was before the index (scheduler/cache/room.py, now scheduler/cache/room.py, with write-behind, issue 12 item 7):
rank every candidate on every plan. Kept verbatim as the reference the index must agree with, choice for
choice; the changes are the conversation class (issue 12 item 6) in both ranks, after the superseded
flag, so the same rule is compared with conversations active too (constant False without them), and the
hybrid branch's checkpoint weights (issue 16: a block frees 1 + units per checkpoint in its tier, pinned
blocks' checkpoints go when nothing else frees enough), which are 1 and nothing for other models.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable

from scheduler.cache.plans import RoomPlan as Plan
from scheduler.cache.tree import CachedBlock, is_superseded

if TYPE_CHECKING:
    from scheduler.cache.view import CacheView as PrefixCache  # the planner's view of the cache


def plan_device_room(cache: "PrefixCache", plan: Plan, count: int, exclude: set[int]) -> bool:
    """Add to `plan` what frees `count` device blocks (beyond the free ones); False when it cannot."""
    short = count - (cache.tiers.num_free_ids("device") - cache.ckpt.units_on("device"))
    if short <= 0:
        return True
    weight = cache.ckpt.weight
    candidates = _device_candidates(cache, exclude)
    short -= _drop_pinned_checkpoints(cache, plan, short - sum(weight(b) for b in candidates), exclude)
    victims = _pick(candidates, short, _device_rank, _device_parent(cache, exclude), weight) if short > 0 else []
    if victims is None:
        return False
    host = _HostRoom(cache, plan, exclude)
    for victim in victims:
        if not host.take_slots(1):
            plan.device_drops.append(victim)
            continue
        # issue 16: parked with the states the host tier takes, the most useful first; the rest dropped
        order = _keep_order(cache, victim)
        kept = 0
        while kept < len(order) and host.take_slots(cache.ckpt.units):
            kept += 1
        if kept < len(order) and host.spill_whole(victim, 1 + kept * cache.ckpt.units):
            continue  # issue 28: to disk with all its states when the disk has room for them
        plan.checkpoint_drops += [(victim, k) for k in reversed(order[kept:])]
        host.trimmed[id(victim)] = set(order[kept:])
        plan.parks.append(victim)
    return True


def _keep_order(cache: "PrefixCache", node: CachedBlock) -> list[int]:
    """The node's checkpoints, most useful first: a tip's (no children) last one, then repeatedly the one
    with the smallest gap to the kept one before it (the first: to the path's previous checkpoint,
    `Checkpoints.gap`) goes, the earlier on a tie."""
    if not node.checkpoints:
        return []
    if not node.children:  # issue 28: a tip's last state first (the next turn goes on from it)
        last = max(node.checkpoints)
        return [last] + [k for k in _keep_order_by_gap(cache, node) if k != last]
    return _keep_order_by_gap(cache, node)


def _keep_order_by_gap(cache: "PrefixCache", node: CachedBlock) -> list[int]:
    first = min(node.checkpoints)
    start, kept, gone = first - cache.ckpt.gap(node, first), set(node.checkpoints), []
    while kept:
        gap = lambda k: k - max([j for j in kept if j < k] or [start])  # noqa: E731
        k = min(kept, key=lambda k: (gap(k), k))
        kept.discard(k)
        gone.append(k)
    return gone[::-1]


def _drop_pinned_checkpoints(cache: "PrefixCache", plan: Plan, missing: int, exclude: set[int]) -> int:
    units = cache.ckpt.units
    if missing <= 0 or not units or plan.kind == "extend" and plan.reserve_checkpoints:  # the states a step
        return 0  # takes inside a prompt never cost held ones (it goes on without them); its reply's end may
    match, restores = getattr(plan, "match", None), getattr(plan, "restores", [])  # AllocatePlan's only
    taken_over = match.cow_source if getattr(plan, "takeover", False) else None  # its checkpoints go anyway: counted once
    matched = match.checkpoint if match is not None else None  # goes last: later prompts
    # that branch where this one did (fan-out questions over one context) need it
    restored = set(restores)  # coming back to the device with all their checkpoints: those may stay behind
    held = sorted(((n.last_used, k, n) for n in cache.ckpt.nodes.values()
                   if (n.on_device and (n.ref_count or id(n) in exclude) or n in restored) and n is not taken_over
                   for k in n.checkpoints),
                  key=lambda e: ((e[2], e[1]) == matched, cache.ckpt.gap(e[2], e[1]), e[0], e[1]))
    count = -(-missing // units)
    if count > len(held):
        return 0
    plan.checkpoint_drops += [(n, k) for _, k, n in held[:count]]
    return count * units


class _HostRoom:
    """Host slots as the plan consumes them: free ones, then granted growth, then evicted leaves."""

    def __init__(self, cache: "PrefixCache", plan: Plan, exclude: set[int]):
        self.cache, self.plan, self.exclude = cache, plan, exclude  # exclude: the blocks being restored
        # Slots the plan's own restores give back count as free: a restore and a park may swap a slot
        # (the runner reads such a restore's bytes before the park overwrites them).
        self.trimmed: dict[int, set[int]] = {}  # id(parked victim) -> its checkpoints this plan drops
        self.free = cache.tiers.num_free_ids("host") - cache.ckpt.units_on("host") \
            + sum(self.weight(b) for b in getattr(plan, "restores", []) if b.on_host)
        self.disk_room = cache.tiers.free_slots("disk")
        self.evicted: list[CachedBlock] | None = None

    def weight(self, block: CachedBlock) -> int:
        return self.cache.ckpt.weight(block) - self.cache.ckpt.units * len(self.trimmed.get(id(block), ()))

    def take_slots(self, count: int) -> bool:
        return all(self.take_slot() for _ in range(count))

    def take_slot(self) -> bool:
        cache, plan = self.cache, self.plan
        if cache.tiers.host_blocks == 0:
            return False
        if self.free == 0:
            admission = cache.admission
            committed = admission.host_committed_blocks + plan.host_grow
            segment = min(admission.segment_blocks, cache.tiers.host_blocks - committed)
            if segment > 0 and admission.host_room_for(committed + segment):
                plan.host_grow += segment
                self.free += segment
        while self.free <= 0:
            if not self._evict_host_leaf():
                return False
        self.free -= 1
        return True

    def _evict_host_leaf(self) -> bool:
        """Free a slot: the least valuable host leaf (blocks parked earlier in this plan included) goes to
        disk, or is dropped without room there. A block parked in this plan then skips the host tier."""
        cache, plan = self.cache, self.plan
        where = _virtual_tiers(plan)
        tier = lambda b: where.get(id(b), b.tier)  # noqa: E731
        leaves = [b for b in list(cache.tiers.blocks("host").values()) + plan.parks if tier(b) == "host" and b.ref_count == 0
                  and id(b) not in self.exclude and not any(tier(c) in ("device", "host") for c in b.children.values())]
        if not leaves:
            return False
        victim = min(leaves, key=_host_rank)
        has_file = victim.disk_copy and victim not in plan.copy_drops  # a copy this plan deleted needs room again
        need = self.weight(victim) - (self._files(victim) if has_file else 0)  # written behind: only the
        # checkpoints without a file need room
        while self.disk_room < need and cache.tiers.disk_blocks and self._make_disk_room(tier, victim):
            pass
        was_parked = victim in plan.parks
        if was_parked:
            plan.parks.remove(victim)
        if self.disk_room >= need:
            plan.spills.append(victim)
            self.disk_room -= need
        else:
            plan.host_drops.append(victim)  # from the device when this plan had parked it: no wasted copy
        self.free += self.weight(victim)
        return True


    def spill_whole(self, victim: CachedBlock, taken: int) -> bool:
        """A device victim whose states do not all fit the host tier: to disk with all of them when it has
        (or can make) room, the `taken` host slots given back."""
        cache, plan = self.cache, self.plan
        if not cache.tiers.disk_blocks:
            return False
        where = _virtual_tiers(plan)
        tier = lambda b: where.get(id(b), b.tier)  # noqa: E731
        has_file = victim.disk_copy and victim not in plan.copy_drops
        need = self.weight(victim) - (self._files(victim) if has_file else 0)
        while self.disk_room < need and self._make_disk_room(tier, victim):
            pass
        if self.disk_room < need:
            return False
        self.disk_room -= need
        self.free += taken
        plan.spills.append(victim)
        return True

    def _files(self, block: CachedBlock) -> int:
        """Disk slots a resident block's files take: its own and its checkpoints' written-behind copies."""
        ckpt = self.cache.ckpt
        kept = set(block.checkpoints) - self.trimmed.get(id(block), set())
        return 1 + ckpt.units * len({(block.digest, k) for k in kept} & ckpt.store.copies)

    def _make_disk_room(self, tier, victim) -> bool:
        """One file's room: a written-behind copy goes first (its block stays resident), else a disk leaf."""
        cache, plan = self.cache, self.plan
        copies = [b for b in cache.tiers.blocks("copies").values() if b not in plan.copy_drops and tier(b) in ("device", "host")
                  and b is not victim]
        if copies:
            copy = min(copies, key=_host_rank)
            plan.copy_drops.append(copy)
            self.disk_room += self._files(copy)  # its checkpoints' copies go with it
            return True
        disk_leaves = [b for b in cache.tiers.blocks("disk").values() if not b.children and tier(b) == "disk"
                       and id(b) not in self.exclude and b not in plan.disk_drops]
        if disk_leaves:
            dropped = min(disk_leaves, key=_host_rank)
            plan.disk_drops.append(dropped)
            self.disk_room += self.weight(dropped)
            return True
        return False


def _virtual_tiers(plan: Plan) -> dict[int, str]:
    """Where the plan has put each block it moved so far ("gone" for drops)."""
    where = {id(b): "host" for b in plan.parks}
    where.update({id(b): "disk" for b in plan.spills})
    where.update({id(b): "gone" for b in plan.host_drops + plan.device_drops + plan.disk_drops})
    return where


def _device_candidates(cache: "PrefixCache", exclude: set[int]) -> list[CachedBlock]:
    return [b for b in cache.tiers.blocks("device").values() if b.ref_count == 0 and id(b) not in exclude]


def _device_parent(cache: "PrefixCache", exclude: set[int]) -> Callable[[CachedBlock], CachedBlock | None]:
    def parent(block: CachedBlock) -> CachedBlock | None:
        p = block.parent
        ok = p is not None and p.on_device and p.ref_count == 0 and id(p) not in exclude
        return p if ok else None
    return parent


def _device_rank(block: CachedBlock, gone: set[int]) -> tuple:
    has_device_child = any(c.on_device and id(c) not in gone for c in block.children.values())
    return (has_device_child, not is_superseded(block), active(block), block.last_used)


def _host_rank(block: CachedBlock) -> tuple:
    return (not is_superseded(block), active(block), block.last_used)


active: Callable[[CachedBlock], bool] = lambda block: False  # noqa: E731  set by the test to the cache's


def _pick(candidates: list[CachedBlock], count: int, rank, parent_of, weight) -> list[CachedBlock] | None:
    """The best victims in rank order, as if each were removed before the next is chosen, until they free
    `count` slots (a block frees `weight(block)`)."""
    gone: set[int] = set()
    heap = [(rank(b, gone), id(b), b) for b in candidates]
    heapq.heapify(heap)
    out: list[CachedBlock] = []
    freed = 0
    while heap and freed < count:
        key, ident, block = heapq.heappop(heap)
        if ident in gone:
            continue
        current = rank(block, gone)
        if current != key:  # a child left since this entry was made: it ranks better now
            heapq.heappush(heap, (current, ident, block))
            continue
        out.append(block)
        freed += weight(block)
        gone.add(ident)
        parent = parent_of(block)
        if parent is not None and id(parent) not in gone:
            heapq.heappush(heap, (rank(parent, gone), id(parent), parent))
    return out if freed >= count else None
