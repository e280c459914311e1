"""Plans: what the conversation cache would do to make room, decided without changing anything.

`PrefixCache.plan_allocate` / `plan_extend` / `plan_release` return a Plan; the memory admission grants
or refuses it whole (scheduler/memory_admission.py); only a granted plan is applied
(`PrefixCache.apply`), and its byte moves reach the engine in one call (`BlockMover.apply`). A refused
plan leaves every block where it was, because nothing was touched to make it.

Room on the device is made in value order: unpinned device blocks, leaves first (a tail leaves before the
head it hangs from), superseded branches before live tips, then least recently used. Each parked block
needs a host slot: a free one, else a new segment of the host tier (a "grow"), else the least valuable
host leaf goes to disk (a "spill") or, without room there, is dropped. The candidates of each tier are
kept in that order as blocks move (scheduler/eviction_index.py); a plan reads them with the blocks already
chosen set aside (scheduler/eviction_sim.py), so a parent becomes a candidate once its last device child is
chosen, exactly as if the blocks had been moved one by one, and nothing is scanned or changed.
Hybrid models (scheduler/checkpoints.py): a block's state checkpoints take slots of its tier, so a victim
frees its weight (1 + units per checkpoint) and needs as many host slots or disk files; the order is the
same. Only when the unpinned blocks cannot free enough do the checkpoints on pinned blocks go.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.cache_tree import CachedBlock, PrefixMatch
from scheduler.checkpoint_spacing import most_useful
from scheduler.eviction_sim import HostLeaves, device_victims, movable_device_weight

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
    copy_drops: list[CachedBlock] = field(default_factory=list)  # written-behind files deleted for room (the
    # blocks stay where they are, to be written again later)
    device_grow: int = 0  # elastic pool: ids added at the top first (scheduler/device_pool.py)
    relocations: list[tuple[CachedBlock, int]] = field(default_factory=list)  # shrink: (block, its new id)
    shrink_to: int = -1  # shrink: the pool's size afterwards
    stopped_by: str = ""  # shrink: why it could not reach its target
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
                                           ("device_grow", self.device_grow),
                                           ("restore", [b for b in loads if not b.on_device])) if present}


def plan_device_room(cache: "PrefixCache", plan: Plan, count: int, exclude: set[CachedBlock]) -> bool:
    """Add to `plan` what frees `count` device blocks (beyond the free ones); False when it cannot.
    `exclude`: the blocks this plan pins or copies from (never moved by it). A block that carries
    checkpoints (hybrid models) frees, and needs in the host tier, their slots too."""
    short = count - (cache._dev_free.num_free - cache.ckpt.units_on("device")) - plan.device_grow
    short -= plan_device_growth(cache, plan, short)  # an elastic pool grows before anything is parked
    if short <= 0:
        return True
    short -= _drop_pinned_checkpoints(cache, plan, short - movable_device_weight(cache.index, exclude), exclude)
    victims = device_victims(cache.index, short, exclude) if short > 0 else []
    if victims is None:
        return False
    host = _HostRoom(cache, plan, exclude)
    for victim in victims:
        if host.take_slots(1):
            _park_with_states(cache, plan, host, victim)
        else:
            plan.device_drops.append(victim)
            host.leaves.move_down(victim)
    return True


def _park_with_states(cache: "PrefixCache", plan: Plan, host: "_HostRoom", victim: CachedBlock) -> None:
    """A device victim whose block has a host slot goes there with as many of its checkpoints as the host
    tier takes, the most useful first (`park_order`); the rest are planned as checkpoint drops, the least
    useful first. Before, a block whose states did not all fit was dropped with its K/V and states."""
    order = park_order(cache.ckpt.gap, victim)
    kept = 0
    while kept < len(order) and host.take_slots(cache.ckpt.units):
        kept += 1
    left = order[kept:][::-1]
    plan.checkpoint_drops += [(victim, k) for k in left]
    host.trimmed[victim] = set(left)
    plan.parks.append(victim)
    host.leaves.park(victim)


def park_order(gap, node: CachedBlock) -> list[int]:
    """The node's checkpoints (k), the most useful first: the one whose loss costs least recompute (the
    smallest gap to the one before it on the path, `gap(node, k)` for the first) goes first, the earlier on
    a tie, gaps counted again after each goes (checkpoint_spacing.most_useful)."""
    if not node.checkpoints:
        return []
    first = min(node.checkpoints)
    return most_useful(node.checkpoints, first - gap(node, first), ())


def plan_device_growth(cache: "PrefixCache", plan: Plan, short: int) -> int:
    """Add to `plan` the pool growth that covers `short` blocks, in whole segments, within the ceiling.
    Returns the blocks it adds (0: the pool is at its ceiling, or not elastic)."""
    admission = cache.admission
    room = admission.device_ceiling_blocks - cache.num_blocks - plan.device_grow
    if room <= 0 or short <= 0:
        return 0
    segment = admission.device_segment_blocks
    grow = min(room, -(-short // segment) * segment)
    plan.device_grow += grow
    return grow


def _drop_pinned_checkpoints(cache: "PrefixCache", plan: Plan, missing: int, exclude: set[CachedBlock]) -> int:
    """When the unpinned blocks cannot free enough, the checkpoints on pinned device blocks (and on those
    this plan pins or restores: a matched checkpoint's state is read already) go, those whose loss costs
    least recompute first (`Checkpoints.gap`), then the oldest, the one the match ends at last; the blocks
    stay. Without the restored blocks' a prompt that fits the pool
    could wait forever for room its prefix's checkpoints take (nothing running would free it).
    Returns the slots freed: 0 when that is not enough either (then nothing is planned). Scans the
    checkpointed nodes, only on this last resort."""
    units = cache.ckpt.units
    if missing <= 0 or not units or plan.kind == "extend" and plan.reserve_checkpoints:  # the states a step
        return 0  # takes inside a prompt never cost held ones (it goes on without them); its reply's end may
    taken_over = plan.match.cow_source if plan.takeover else None  # its checkpoints go anyway: counted once
    matched = plan.match.checkpoint if plan.match is not None else None  # goes last: later prompts
    # that branch where this one did (fan-out questions over one context) need it
    restored = set(plan.restores)  # coming back to the device with all their checkpoints: those may stay behind
    held = sorted(((n.last_used, k, n) for n in cache.ckpt.nodes.values()
                   if (n.on_device and (n.ref_count or n in exclude) or n in restored) and n is not taken_over
                   for k in n.checkpoints),
                  key=lambda e: ((e[2], e[1]) == matched, cache.ckpt.gap(e[2], e[1]), e[0], e[1]))
    count = -(-missing // units)
    if count > len(held):
        return 0
    plan.checkpoint_drops += [(n, k) for _, k, n in held[:count]]
    return count * units


class _HostRoom:
    """Host slots as the plan consumes them: free ones, then granted growth, then evicted leaves."""

    def __init__(self, cache: "PrefixCache", plan: Plan, exclude: set[CachedBlock]):
        self.cache, self.plan = cache, plan
        self.leaves = HostLeaves(cache.index, exclude)  # exclude: the blocks being restored
        self.trimmed: dict[CachedBlock, set[int]] = {}  # parked victims' checkpoints this plan drops
        # Slots the plan's own restores give back count as free: a restore and a park may swap a slot
        # (the runner reads such a restore's bytes before the park overwrites them).
        self.free = cache._host_free.num_free - cache.ckpt.units_on("host") \
            + sum(self.weight(b) for b in plan.restores if b.on_host)
        self.disk_room = cache.disk_free

    def weight(self, block: CachedBlock) -> int:
        """Slots a block takes in a tier: 1, plus its checkpoints' (less those this plan drops)."""
        return self.cache.ckpt.weight(block) - self.cache.ckpt.units * len(self.trimmed.get(block, ()))

    def take_slots(self, count: int) -> bool:
        """`count` host slots (a block and its checkpoints); on False some may be spent: the plan then
        uses fewer host slots than it could, never more than there are."""
        return all(self.take_slot() for _ in range(count))

    def take_slot(self) -> bool:
        cache, plan = self.cache, self.plan
        if cache.host_blocks == 0:
            return False
        if self.free <= 0:
            admission = cache.admission
            committed = admission.host_committed_blocks + plan.host_grow
            segment = min(admission.segment_blocks, cache.host_blocks - committed)
            if segment > 0 and admission.host_room_for(committed + segment):
                plan.host_grow += segment
                self.free += segment
        while self.free <= 0:
            if not self._evict_host_leaf():
                return False
        self.free -= 1
        return True

    def _evict_host_leaf(self) -> bool:
        """Free slots: the least valuable host leaf (blocks parked earlier in this plan included) goes to
        disk, or is dropped without room there. A block parked in this plan then skips the host tier."""
        cache, plan = self.cache, self.plan
        victim = self.leaves.take_host_leaf()
        if victim is None:
            return False
        has_file = victim.disk_copy and victim not in plan.copy_drops  # a copy this plan deleted needs room again
        need = self.weight(victim) - (self._copy_slots(victim) if has_file else 0)  # written behind: only
        # the checkpoints without a file need room
        if has_file:
            self.leaves.leaving(victim)  # its own file is not one to delete for the room
        while self.disk_room < need and cache.disk_blocks and self._make_disk_room():
            pass
        if victim in self.leaves.parked:
            plan.parks.remove(victim)
        if self.disk_room >= need:
            plan.spills.append(victim)
            self.disk_room -= need
        else:
            plan.host_drops.append(victim)  # from the device when this plan had parked it: no wasted copy
        self.leaves.move_down(victim)
        self.free += self.weight(victim)
        return True

    def _make_disk_room(self) -> bool:
        """Room for files: a written-behind copy goes first (its block stays resident; its checkpoints'
        copies go with it), else a disk leaf (with its checkpoint files). False when neither is left."""
        copy = self.leaves.take_disk_copy()
        if copy is not None:
            self.plan.copy_drops.append(copy)
            self.disk_room += self._copy_slots(copy)
            return True
        dropped = self.leaves.take_disk_leaf()
        if dropped is not None:
            self.plan.disk_drops.append(dropped)
            self.disk_room += self.weight(dropped)
            return True
        return False

    def _copy_slots(self, block: CachedBlock) -> int:
        """Disk slots the written-behind files of a resident block take: its own and its checkpoints'."""
        ckpt, trimmed = self.cache.ckpt, self.trimmed.get(block, ())
        return 1 + ckpt.units * sum((block.digest, k) in ckpt.store.copies for k in block.checkpoints
                                    if k not in trimmed)
