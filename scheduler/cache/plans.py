"""Plans: what one cache call decided, one type per kind, nothing in them done yet; and the Allocation a
granted admission gives its request.

`PrefixCache.plan_allocate` / `plan_extend` / `plan_shrink` / `plan_release` return one of these and change
nothing; the memory admission grants or refuses it whole (it reads `points` and `host_grow`); only a granted
plan is applied (`PrefixCache.apply`, which dispatches on the type), and its byte moves reach the engine in
one call (`BlockMover.apply`). A refused plan leaves every block where it was.

    Plan                 kind, points (the moves that need a grant)
    ├── RoomPlan         what making room on the device moves: parks, drops, spills, growth
    │   ├── AllocatePlan a request's admission: its match, restores, fresh blocks
    │   ├── ExtendPlan   a running request's next step: fresh blocks
    │   └── ShrinkPlan   the elastic pool's shrink: relocations, parks, the size it reaches
    └── ReleasePlan      a request done (or preempted): its blocks join the tree
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from scheduler.cache.tree import CachedBlock, PrefixMatch


@dataclass
class Allocation:
    """A request's block table (shared cached blocks first, then its own) and the copies its admission ran."""

    block_table: list[int]
    num_shared: int
    cached_tokens: int
    reused_by_tier: dict[str, int] = field(default_factory=dict)
    salt: str = ""
    conversation: str | None = None  # named by the client; None: named by its first block at release
    parks: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (host slot or -1 for disk, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device block, device block)
    # hybrid models (scheduler/cache/checkpoints.py): the state to load into the sequence, the checkpoints the
    # request has room reserved for, and those it took (position -> state) that its release attaches
    checkpoint_state: Any = None
    state_window: int = 0  # or (no checkpoint near the match's end): tokens that recompute the state
    checkpoints_reserved: int = 0
    pending_checkpoints: dict[int, Any] = field(default_factory=dict)
    branch_points: set[int] = field(default_factory=set)  # pending ones where prompts branch (given up last)


@dataclass(kw_only=True)
class Plan:
    """Ordered decisions of one cache call. Nothing in it has happened yet."""

    kind: ClassVar[str] = ""
    host_grow: ClassVar[int] = 0  # host slots to commit first (RoomPlan sets its own)

    @property
    def points(self) -> set[str]:
        """The kinds of move this plan needs granted (the fault tests refuse each in turn)."""
        return set()


@dataclass(kw_only=True)
class RoomPlan(Plan):
    """Room on the device, made in value order (scheduler/cache/room.py), and what it costs the tiers below."""

    parks: list[CachedBlock] = field(default_factory=list)  # device -> host, in this order
    device_drops: list[CachedBlock] = field(default_factory=list)  # no host slot for them: dropped
    host_grow: int = 0  # host slots to commit first
    spills: list[CachedBlock] = field(default_factory=list)  # host -> disk, to free their slots
    host_drops: list[CachedBlock] = field(default_factory=list)  # host leaves dropped to free their slots
    disk_drops: list[CachedBlock] = field(default_factory=list)  # disk leaves dropped to make room for spills
    copy_drops: list[CachedBlock] = field(default_factory=list)  # written-behind files deleted for room (the
    # blocks stay where they are, to be written again later)
    device_grow: int = 0  # elastic pool: ids added at the top first (scheduler/cache/device_pool.py)
    # hybrid models: checkpoints on pinned blocks, dropped for room (their blocks stay)
    checkpoint_drops: list[tuple[CachedBlock, int]] = field(default_factory=list)

    def loads(self) -> list[CachedBlock]:
        """Blocks this plan brings back from a lower tier (restores and a copy-on-write source)."""
        return []

    @property
    def points(self) -> set[str]:
        return {name for name, present in (("park", self.parks), ("grow", self.host_grow), ("spill", self.spills),
                                           ("device_grow", self.device_grow),
                                           ("restore", [b for b in self.loads() if not b.on_device])) if present}


@dataclass(kw_only=True)
class AllocatePlan(RoomPlan):
    """A request's admission: pin the matched blocks (restoring parked ones), `fresh` blocks of its own."""

    kind: ClassVar[str] = "allocate"
    match: PrefixMatch
    fresh: int = 0  # new device blocks for the request
    restores: list[CachedBlock] = field(default_factory=list)  # matched blocks brought back to the device
    unreadable: list[CachedBlock] = field(default_factory=list)  # disk files that failed verification
    payloads: dict[int, object] = field(default_factory=dict)  # id(block) -> bytes read from disk
    takeover: bool = False  # the partial-hit block becomes the request's own first block (no copy)
    # hybrid models (scheduler/cache/checkpoints.py)
    reserve_checkpoints: int = 0  # checkpoints the request will take: a device slot each, held from now
    checkpoint_state: Any = None  # the matched checkpoint's state, read when planned
    checkpoint_loads: dict[int, dict] = field(default_factory=dict)  # id(disk block) -> {k: state}

    def loads(self) -> list[CachedBlock]:
        source = self.match.cow_source
        return self.restores + ([source] if source and not source.on_device and not self.takeover else [])

    def reuse_by_tier(self) -> dict[str, int]:
        """Reused tokens by the tier they come from (before anything moves)."""
        match = self.match
        host = sum(len(b.tokens) for b in self.restores if b.on_host)
        disk = sum(len(b.tokens) for b in self.restores if not b.on_host)
        source = match.cow_source
        if source is not None and not source.on_device and not self.takeover:
            host, disk = (host + match.cow_tokens, disk) if source.on_host else (host, disk + match.cow_tokens)
        return {"device": match.num_tokens - host - disk, "host": host, "disk": disk}


@dataclass(kw_only=True)
class ExtendPlan(RoomPlan):
    """A running request's next step: fresh blocks so its table holds the step's tokens."""

    kind: ClassVar[str] = "extend"
    allocation: Allocation
    fresh: int = 0
    reserve_checkpoints: int = 0  # checkpoints the step takes (hybrid models): a device slot each


@dataclass(kw_only=True)
class ShrinkPlan(RoomPlan):
    """The elastic pool's shrink (scheduler/cache/device_pool.py): only parks and host growth of the room
    fields are used; nothing is dropped to shrink."""

    kind: ClassVar[str] = "shrink"
    relocations: list[tuple[CachedBlock, int]] = field(default_factory=list)  # (block, its new id)
    shrink_to: int = -1  # the pool's size afterwards
    stopped_by: str = ""  # why it could not reach its target


@dataclass(kw_only=True)
class ReleasePlan(Plan):
    """A request is done (`preempt` False) or preempted: its computed tokens' blocks join the tree, with the
    checkpoints it took and `final_state` (hybrid models: its state after num_computed tokens)."""

    allocation: Allocation
    token_ids: list[int]
    num_computed: int
    final_state: Any = None
    preempt: bool = False

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "preempt" if self.preempt else "release"
