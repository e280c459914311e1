"""Moving KV block bytes between the tiers, for the conversation cache.

The cache (scheduler/cache/prefix_cache.py) decides and applies a granted plan to its bookkeeping; the plan's
byte moves then reach the mover as one BlockMoves, on the event loop between engine steps, so no step
ever reads a block that is in flight. Their order keeps every copy safe: host growth, disk writes (they
read slots and blocks the later moves may reuse), parks, restores, disk loads, copies.
`EngineBlockMover` works on the engine's pools (one runner call) and the disk tier's files;
`RecordingMover` only records (unit tests of the policy).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.cache.tree import CachedBlock
from scheduler.cache.disk_tier import DiskEntry, DiskTier

log = logging.getLogger("strata.cache")


@dataclass
class BlockMoves:
    """The byte moves of one applied plan, in the order they must run."""

    grow_host: int = 0  # commit host slots up to this many in total first (0: no growth)
    grow_device: int = 0  # the device pool's new size, before every other move (0: unchanged)
    shrink_device: int = 0  # the device pool's new size, after every other move (0: unchanged)
    saves: list[tuple[CachedBlock, str, int]] = field(default_factory=list)  # (block, "device"|"host", index)
    parks: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    writes: list[tuple[int, Any]] = field(default_factory=list)  # (device block, bytes read from disk)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device block, device block)


class BlockMover(Protocol):
    def apply(self, moves: BlockMoves) -> list[CachedBlock]:
        """Run every move in order; returns the blocks whose disk write failed (their bytes are lost)."""

    def save(self, node: CachedBlock) -> bool:
        """Write the block (from wherever it is now) to the disk tier; False when that failed."""

    def read_disk(self, node: CachedBlock) -> Any | None:
        """The block's bytes from disk, verified; None when the file is missing or invalid."""

    def delete_disk(self, node: CachedBlock) -> None: ...


class RecordingMover:
    """Records every move; disk operations succeed unless told otherwise."""

    def __init__(self):
        self.moves: list[tuple] = []
        self.fail_saves = False
        self.unreadable: set[bytes] = set()

    def apply(self, moves: BlockMoves) -> list[CachedBlock]:
        if moves.grow_host:
            self.grow_host(moves.grow_host)
        if moves.grow_device:
            self.moves.append(("resize_device", moves.grow_device))
        failed = [block for block, _, _ in moves.saves if not self.save(block)]
        for device_id, slot in moves.parks:
            self.park(device_id, slot)
        for slot, device_id in moves.restores:
            self.restore(slot, device_id)
        for device_id, payload in moves.writes:
            self.write_device(device_id, payload)
        for src, dst in moves.copies:
            self.copy(src, dst)
        if moves.shrink_device:
            self.moves.append(("resize_device", moves.shrink_device))
        return failed

    def park(self, device_id, host_slot):
        self.moves.append(("park", device_id, host_slot))

    def restore(self, host_slot, device_id):
        self.moves.append(("restore", host_slot, device_id))

    def copy(self, src, dst):
        self.moves.append(("copy", src, dst))

    def grow_host(self, num_blocks):
        self.moves.append(("grow_host", num_blocks))

    def save(self, node):
        self.moves.append(("save", node.tokens))
        return not self.fail_saves

    def read_disk(self, node):
        return None if node.digest in self.unreadable else ("payload", node.tokens)

    def write_device(self, device_id, payload):
        self.moves.append(("load", payload[1], device_id))

    def delete_disk(self, node):
        self.moves.append(("delete", node.tokens))


class EngineBlockMover:
    """Moves bytes between the runner's pools (engine.sequence.ModelRunner) and a DiskTier, and keeps
    count, seconds and bytes per kind of move (`totals`, exported as metrics)."""

    def __init__(self, runner, disk: DiskTier | None):
        self.runner = runner
        self.disk = disk
        self.block_bytes = runner.layout.bytes_per_block
        self.totals: dict[str, dict[str, float]] = {}

    def _timed(self, op: str, fn, *args, count: int = 1):
        started = time.perf_counter()
        result = fn(*args)
        entry = self.totals.setdefault(op, {"count": 0, "seconds": 0.0, "bytes": 0})
        entry["count"] += count
        entry["seconds"] += time.perf_counter() - started
        entry["bytes"] += self.block_bytes * count
        return result

    def apply(self, moves: BlockMoves) -> list[CachedBlock]:
        """Disk writes first (they read what the runner's moves may overwrite), then one runner call."""
        if moves.grow_host:
            self.runner.grow_host(moves.grow_host)
        if moves.grow_device:
            self.runner.resize_device(moves.grow_device)
        failed = [block for block, tier, index in moves.saves
                  if not (self.disk is not None and self._timed("save_disk", self._save, block, tier, index))]
        writes = [(d, k, v) for d, (k, v) in moves.writes]
        started = time.perf_counter()
        self.runner.apply_moves(moves.parks, moves.restores, writes, moves.copies)
        if moves.shrink_device:  # after the copies that moved blocks down out of the range it gives back
            self.runner.resize_device(moves.shrink_device)
        seconds = time.perf_counter() - started
        total = len(moves.parks) + len(moves.restores) + len(writes) + len(moves.copies)
        for op, n in (("park", len(moves.parks)), ("restore_host", len(moves.restores)),
                      ("restore_disk", len(writes)), ("copy", len(moves.copies))):
            if n:  # the one call's time, shared out by the number of blocks of each kind
                entry = self.totals.setdefault(op, {"count": 0, "seconds": 0.0, "bytes": 0})
                entry["count"] += n
                entry["seconds"] += seconds * n / total
                entry["bytes"] += self.block_bytes * n
        return failed

    def save(self, node: CachedBlock) -> bool:
        """Write a block from wherever it is now (shutdown flush, write-behind)."""
        tier, index = ("device", node.device_id) if node.on_device else ("host", node.host_slot)
        return self.disk is not None and self._timed("save_disk", self._save, node, tier, index)

    def _save(self, node: CachedBlock, tier: str, index: int) -> bool:
        k, v = self.runner.read_block(tier, index)
        try:
            self.disk.write(DiskEntry(node.digest, node.parent.digest, node.tokens), k, v)
        except OSError as exc:
            log.warning("could not write a cache block to disk: %s", exc, extra={"fields": {"error": str(exc)}})
            return False
        return True

    def read_disk(self, node: CachedBlock):
        try:
            _, k, v = self._timed("read_disk", self.disk.read, node.digest)
        except (OSError, ValueError) as exc:
            log.warning("cache block file unusable, recomputing instead: %s", exc,
                        extra={"fields": {"error": str(exc)}})
            return None
        return k, v

    def delete_disk(self, node):
        self.disk.delete(node.digest)
