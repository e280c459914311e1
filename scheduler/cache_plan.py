"""Plans: what the conversation cache would do to make room, decided without changing anything.

`PrefixCache.plan_allocate` / `plan_extend` / `plan_release` return a Plan; the memory admission grants
or refuses it whole (scheduler/memory_admission.py); only a granted plan is applied
(`PrefixCache.apply`), and its byte moves reach the engine in one call (`BlockMover.apply`). A refused
plan leaves every block where it was, because nothing was touched to make it.

Room on the device is made in value order: unpinned device blocks, leaves first (a tail leaves before the
head it hangs from), superseded branches before live tips, then least recently used. Each parked block
needs a host slot: a free one, else a new segment of the host tier (a "grow"), else the least valuable
host leaf goes to disk (a "spill") or, without room there, is dropped. The choice is simulated on a heap
with the blocks already chosen set aside, so a parent becomes a candidate once its last device child is
chosen, exactly as if the blocks had been moved one by one.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from scheduler.cache_tree import CachedBlock, PrefixMatch, is_superseded

if TYPE_CHECKING:
    from scheduler.prefix_cache import Allocation, PrefixCache


@dataclass
class Plan:
    """Ordered decisions of one cache call. Nothing in it has happened yet."""

    kind: str  # allocate | extend | release | preempt
    fresh: int = 0  # new device blocks for the request
    parks: list[CachedBlock] = field(default_factory=list)  # device -> host, in this order
    device_drops: list[CachedBlock] = field(default_factory=list)  # no host slot for them: dropped
    host_grow: int = 0  # host slots to commit first
    spills: list[CachedBlock] = field(default_factory=list)  # host -> disk, to free their slots
    host_drops: list[CachedBlock] = field(default_factory=list)  # host leaves dropped to free their slots
    disk_drops: list[CachedBlock] = field(default_factory=list)  # disk leaves dropped to make room for spills
    restores: list[CachedBlock] = field(default_factory=list)  # matched blocks brought back to the device
    unreadable: list[CachedBlock] = field(default_factory=list)  # disk files that failed verification
    payloads: dict[int, object] = field(default_factory=dict)  # id(block) -> bytes read from disk
    match: PrefixMatch | None = None
    takeover: bool = False  # the partial-hit block becomes the request's own first block (no copy)
    allocation: "Allocation | None" = None  # extend / release: the request's allocation
    token_ids: list[int] = field(default_factory=list)  # release: what the request computed
    num_computed: int = 0
    # hybrid models (scheduler/checkpoints.py)
    reserve_checkpoints: int = 0  # checkpoints the request will take: a device slot each, held from now
    checkpoint_state: object = None  # allocate: the matched checkpoint's state, read when planned
    checkpoint_loads: dict[int, dict] = field(default_factory=dict)  # id(disk block) -> {k: state}
    final_state: object = None  # release: the state after num_computed tokens (None: take no checkpoint)
    checkpoint_drops: list[tuple[CachedBlock, int]] = field(default_factory=list)  # on pinned blocks, for room

    @property
    def points(self) -> set[str]:
        """The kinds of move this plan needs granted (the fault tests refuse each in turn)."""
        loads = self.restores + ([self.match.cow_source] if self.match and self.match.cow_source
                                 and not self.match.cow_source.on_device and not self.takeover else [])
        return {name for name, present in (("park", self.parks), ("grow", self.host_grow), ("spill", self.spills),
                                           ("restore", [b for b in loads if not b.on_device])) if present}


def plan_device_room(cache: "PrefixCache", plan: Plan, count: int, exclude: set[int]) -> bool:
    """Add to `plan` what frees `count` device blocks (beyond the free ones); False when it cannot.
    A block that carries checkpoints frees (and needs in the host tier) their slots too."""
    short = count - (cache._dev_free.num_free - cache.ckpt.units_on("device"))
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
        (plan.parks if host.take_slots(weight(victim)) else plan.device_drops).append(victim)
    return True


def _drop_pinned_checkpoints(cache: "PrefixCache", plan: Plan, missing: int, exclude: set[int]) -> int:
    """When the unpinned blocks cannot free enough, the checkpoints on pinned device blocks (and on those
    this plan pins: a matched checkpoint's state is read already) go, oldest first; the blocks stay.
    Returns the slots freed: 0 when that is not enough either (then nothing is planned)."""
    units = cache.ckpt.units
    if missing <= 0 or not units:
        return 0
    held = sorted(((n.last_used, k, n) for n in cache.ckpt.nodes.values()
                   if n.on_device and (n.ref_count or id(n) in exclude) for k in n.checkpoints),
                  key=lambda e: (e[0], e[1]))
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
        ckpt = self.weight = cache.ckpt.weight
        self.free = cache._host_free.num_free - cache.ckpt.units_on("host") \
            + sum(ckpt(b) for b in plan.restores if b.on_host)
        self.disk_room = cache.disk_blocks - len(cache._on_disk) - cache.ckpt.units_on("disk")
        self.evicted: list[CachedBlock] | None = None

    def take_slots(self, count: int) -> bool:
        """`count` host slots (a block and its checkpoints); on False some may be spent: the plan then
        uses fewer host slots than it could, never more than there are."""
        return all(self.take_slot() for _ in range(count))

    def take_slot(self) -> bool:
        cache, plan = self.cache, self.plan
        if cache.host_blocks == 0:
            return False
        if self.free == 0:
            admission = cache.admission
            committed = admission.host_committed_blocks + plan.host_grow
            segment = min(admission.segment_blocks, cache.host_blocks - committed)
            if segment > 0 and admission.host_room_for(committed + segment):
                plan.host_grow += segment
                self.free += segment
        if self.free == 0 and not self._evict_host_leaf():
            return False
        self.free -= 1
        return True

    def _evict_host_leaf(self) -> bool:
        """Free a slot: the least valuable host leaf (blocks parked earlier in this plan included) goes to
        disk, or is dropped without room there. A block parked in this plan then skips the host tier."""
        cache, plan = self.cache, self.plan
        where = _virtual_tiers(plan)
        tier = lambda b: where.get(id(b), b.tier)  # noqa: E731
        leaves = [b for b in list(cache._on_host.values()) + plan.parks if tier(b) == "host" and b.ref_count == 0
                  and id(b) not in self.exclude and not any(tier(c) in ("device", "host") for c in b.children.values())]
        if not leaves:
            return False
        victim = min(leaves, key=_host_rank)
        need = self.weight(victim)
        while self.disk_room < need and cache.disk_blocks:
            disk_leaves = [b for b in cache._on_disk.values()
                           if not b.children and tier(b) == "disk" and id(b) not in self.exclude]
            if not disk_leaves:
                break
            dropped = min(disk_leaves, key=_host_rank)
            plan.disk_drops.append(dropped)
            where[id(dropped)] = "gone"
            self.disk_room += self.weight(dropped)
        was_parked = victim in plan.parks
        if was_parked:
            plan.parks.remove(victim)
        if self.disk_room >= need:
            plan.spills.append(victim)
            self.disk_room -= need
        else:
            plan.host_drops.append(victim)  # from the device when this plan had parked it: no wasted copy
        self.free += need
        return True


def _virtual_tiers(plan: Plan) -> dict[int, str]:
    """Where the plan has put each block it moved so far ("gone" for drops)."""
    where = {id(b): "host" for b in plan.parks}
    where.update({id(b): "disk" for b in plan.spills})
    where.update({id(b): "gone" for b in plan.host_drops + plan.device_drops + plan.disk_drops})
    return where


def _device_candidates(cache: "PrefixCache", exclude: set[int]) -> list[CachedBlock]:
    return [b for b in cache._on_device.values() if b.ref_count == 0 and id(b) not in exclude]


def _device_parent(cache: "PrefixCache", exclude: set[int]) -> Callable[[CachedBlock], CachedBlock | None]:
    def parent(block: CachedBlock) -> CachedBlock | None:
        p = block.parent
        ok = p is not None and p.on_device and p.ref_count == 0 and id(p) not in exclude
        return p if ok else None
    return parent


def _device_rank(block: CachedBlock, gone: set[int]) -> tuple:
    has_device_child = any(c.on_device and id(c) not in gone for c in block.children.values())
    return (has_device_child, not is_superseded(block), block.last_used)


def _host_rank(block: CachedBlock) -> tuple:
    return (not is_superseded(block), block.last_used)


def _pick(candidates: list[CachedBlock], count: int, rank, parent_of, weight=lambda b: 1) -> list[CachedBlock] | None:
    """The best victims in rank order, as if each were removed before the next is chosen, until they free
    `count` slots (a block frees `weight(block)`: 1, plus its checkpoints' slots)."""
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
