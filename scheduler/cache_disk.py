"""The conversation cache's moves to and from its lower tiers: loads into device blocks, spills to disk,
and the written-behind copies (files of blocks that are still resident).

Moved out of scheduler/prefix_cache.py, whose `apply` calls these on the blocks a granted plan names;
like scheduler/device_pool.py they change the cache's tier indexes, and only from `apply` (or, for the
copies, from the write-behind between the loop's decisions). A block's state checkpoints (hybrid
models, scheduler/checkpoints.py) move with it: a spill writes only the states that have no file yet,
a load keeps their files as copies, and a block copy deleted for room takes its states' copies along.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.block_mover import BlockMoves
from scheduler.cache_tree import CachedBlock

if TYPE_CHECKING:
    from scheduler.prefix_cache import PrefixCache


def load(cache: "PrefixCache", block: CachedBlock, device_id: int, payloads: dict, moves: BlockMoves,
         keep_source: bool, checkpoint_loads: dict | None = None) -> None:
    """Fill `device_id` with a host or disk block's bytes. `keep_source` (a copy-on-write source): the
    block stays where it is; else it leaves its tier (the caller makes it the device block)."""
    if block.on_host:
        moves.restores.append((block.host_slot, device_id))
        if not keep_source:
            cache.ckpt.move(block, "host", "device")
            cache._host_free.free([block.host_slot])
            del cache._on_host[block.host_slot]
            block.host_slot = -1
        return
    moves.writes.append((device_id, payloads[id(block)]))
    cache.stats["disk_loads"] += 1
    if not keep_source:  # the file stays as the resident block's copy: nothing to write back later
        cache.ckpt.load(block, (checkpoint_loads or {}).get(id(block), {}))  # so do its states' files
        del cache._on_disk[block.digest]
        block.on_disk, block.disk_copy = False, True
        cache._disk_copies[block.digest] = block


def spill(cache: "PrefixCache", block: CachedBlock, moves: BlockMoves) -> None:
    """To the disk tier, from wherever it is now (a block this plan would have parked goes straight).
    A block written behind already has its file: it only leaves its resident tier (so do its checkpoints;
    those without a file get one now)."""
    cache.ckpt.spill(block, block.tier)
    written = block.disk_copy
    if written:
        del cache._disk_copies[block.digest]
        block.disk_copy = False
    if block.on_device:
        if not written:
            moves.saves.append((block, "device", block.device_id))
        del cache._on_device[block.device_id]
        cache._dev_free.free([block.device_id])
        block.device_id = -1
    else:
        if not written:
            moves.saves.append((block, "host", block.host_slot))
        cache._host_free.free([block.host_slot])
        del cache._on_host[block.host_slot]
        block.host_slot = -1
    block.on_disk = True
    cache._on_disk[block.digest] = block
    cache.unsaved.pop(id(block), None)
    cache.index.sync(block)
    cache.stats["spills"] += 1


def record_disk_copy(cache: "PrefixCache", block: CachedBlock) -> None:
    """A resident block's file was just written: it needs no write when spilled or at shutdown."""
    assert (block.on_device or block.on_host) and not block.disk_copy and cache.disk_free > 0
    del cache.unsaved[id(block)]
    block.disk_copy = True
    cache._disk_copies[block.digest] = block
    cache.index.sync(block)


def forget_disk_copy(cache: "PrefixCache", block: CachedBlock) -> None:
    """Delete a resident block's file (and its checkpoints' files) for room; the block stays and is written
    again later."""
    cache.ckpt.forget_copies(block)
    del cache._disk_copies[block.digest]
    block.disk_copy = False
    cache.mover.delete_disk(block)
    cache.unsaved[id(block)] = block
    cache.index.sync(block)
