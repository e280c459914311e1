"""A request's share of the conversation cache (its block table), reading matched disk blocks, and where
the reused tokens come from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.cache_tree import CachedBlock, PrefixMatch

if TYPE_CHECKING:
    from scheduler.cache_plan import Plan
    from scheduler.prefix_cache import PrefixCache


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
    # hybrid models (scheduler/checkpoints.py): the state to load into the sequence, the checkpoints the
    # request has room reserved for, and those it took (position -> state) that its release attaches
    checkpoint_state: Any = None
    state_window: int = 0  # or (no checkpoint near the match's end): tokens that recompute the state
    checkpoints_reserved: int = 0
    pending_checkpoints: dict[int, Any] = field(default_factory=dict)
    branch_points: set[int] = field(default_factory=set)  # pending ones where prompts branch (given up last)


def read_disk_blocks(cache: "PrefixCache", match: PrefixMatch) -> tuple[PrefixMatch, dict, list[CachedBlock]]:
    """Bytes of the matched blocks that live only on disk, read first so an unreadable file only shortens
    the match: (the match as far as it is readable, id(block) -> payload, unreadable blocks to drop)."""
    payloads: dict[int, object] = {}
    for i, block in enumerate(match.shared):
        if block.on_device or block.on_host:
            continue
        payload = cache.mover.read_disk(block)
        if payload is None:
            return PrefixMatch(match.shared[:i], None, 0, match.salt, match.conversation), payloads, [block]
        payloads[id(block)] = payload
    source = match.cow_source
    if source is not None and not (source.on_device or source.on_host):
        payload = cache.mover.read_disk(source)
        if payload is None:
            return PrefixMatch(match.shared, None, 0, match.salt, match.conversation), payloads, [source]
        payloads[id(source)] = payload
    return match, payloads, []


def reuse_by_tier(plan: "Plan") -> dict[str, int]:
    """Reused tokens by the tier they come from (before anything moves)."""
    match = plan.match
    host = sum(len(b.tokens) for b in plan.restores if b.on_host)
    disk = sum(len(b.tokens) for b in plan.restores if not b.on_host)
    source = match.cow_source
    if source is not None and not source.on_device and not plan.takeover:
        host, disk = (host + match.cow_tokens, disk) if source.on_host else (host, disk + match.cow_tokens)
    return {"device": match.num_tokens - host - disk, "host": host, "disk": disk}
