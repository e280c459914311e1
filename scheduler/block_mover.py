"""Moving KV block bytes between the tiers, for the conversation cache.

The cache (scheduler/prefix_cache.py) decides; a BlockMover does the copy at the moment the decision is
made, on the event loop between engine steps, so no step ever reads a block that is in flight and no
decision is recorded for bytes that did not move. `EngineBlockMover` works on the engine's device and
host pools and the disk tier's files; `RecordingMover` only records (unit tests of the policy).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from scheduler.cache_tree import CachedBlock
from scheduler.disk_tier import DiskEntry, DiskTier

log = logging.getLogger("strata.cache")


class BlockMover(Protocol):
    def park(self, device_id: int, host_slot: int) -> None: ...
    def restore(self, host_slot: int, device_id: int) -> None: ...
    def copy(self, src_device_id: int, dst_device_id: int) -> None: ...
    def grow_host(self, num_blocks: int) -> None:
        """Commit host slots up to num_blocks in total (the admission granted them)."""

    def save(self, node: CachedBlock) -> bool:
        """Write the block (from wherever it is now) to the disk tier; False when that failed."""

    def read_disk(self, node: CachedBlock) -> Any | None:
        """The block's bytes from disk, verified; None when the file is missing or invalid."""

    def write_device(self, device_id: int, payload: Any) -> None: ...
    def delete_disk(self, node: CachedBlock) -> None: ...


class RecordingMover:
    """Records every move; disk operations succeed unless told otherwise."""

    def __init__(self):
        self.moves: list[tuple] = []
        self.fail_saves = False
        self.unreadable: set[bytes] = set()

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

    def _timed(self, op: str, fn, *args):
        started = time.perf_counter()
        result = fn(*args)
        entry = self.totals.setdefault(op, {"count": 0, "seconds": 0.0, "bytes": 0})
        entry["count"] += 1
        entry["seconds"] += time.perf_counter() - started
        entry["bytes"] += self.block_bytes
        return result

    def park(self, device_id, host_slot):
        self._timed("park", self.runner.move_blocks, [(device_id, host_slot)], [], [])

    def restore(self, host_slot, device_id):
        self._timed("restore_host", self.runner.move_blocks, [], [(host_slot, device_id)], [])

    def copy(self, src, dst):
        self._timed("copy", self.runner.move_blocks, [], [], [(src, dst)])

    def grow_host(self, num_blocks):
        self.runner.grow_host(num_blocks)

    def save(self, node: CachedBlock) -> bool:
        return self.disk is not None and self._timed("save_disk", self._save, node)

    def _save(self, node: CachedBlock) -> bool:
        tier, index = ("device", node.device_id) if node.on_device else ("host", node.host_slot)
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

    def write_device(self, device_id, payload):
        self._timed("restore_disk", self.runner.write_block, device_id, *payload)

    def delete_disk(self, node):
        self.disk.delete(node.digest)
