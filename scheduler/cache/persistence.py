"""The conversation cache across restarts: rebuild the tree (and the checkpoints of hybrid models) from the disk
tier at start-up, flush to it on shutdown.

Only blocks whose whole chain back to a root is on disk are reachable after a restart; a chain whose
parent file is gone leaves an unreachable branch that is dropped (and its files deleted) at load.
"""
from __future__ import annotations

import logging

from scheduler.cache.tree import CachedBlock
from scheduler.cache.disk_tier import DiskEntry
from scheduler.cache.prefix_cache import PrefixCache

log = logging.getLogger("strata.cache.disk")
cache_log = logging.getLogger("strata.cache")  # the checkpoint index's line has always been the cache's


def load_disk_index(cache: PrefixCache, entries: list[DiskEntry]) -> int:
    """Attach every disk entry as a disk-tier node under its parent. Call before serving.

    A first block's parent is its salt's root; roots of salts not seen yet in this run are created by
    digest and adopted when a request with that salt arrives (`Tree.root`). Returns blocks attached.
    """
    by_parent: dict[bytes, list[DiskEntry]] = {}
    for entry in entries:
        by_parent.setdefault(entry.parent_digest, []).append(entry)
    digests = {e.digest for e in entries}
    stack = [cache.tree.root_for_digest(parent) for parent in by_parent if parent not in digests]
    attached = 0
    while stack:
        parent = stack.pop()
        for entry in by_parent.pop(parent.digest, []):
            if cache.disk_free <= 0 or entry.tokens in parent.children:
                cache.mover.delete_disk(CachedBlock(entry.tokens, None, digest=entry.digest))
                continue
            node = cache.tree.insert(parent, entry.tokens, digest=entry.digest)
            cache.tiers.add_disk_block(node)
            cache.index.sync(node)
            stack.append(node)
            attached += 1
    log.info("conversation cache: %d blocks loaded from disk", attached,
             extra={"fields": {"loaded_blocks": attached}})
    return attached


def flush_to_disk(cache: PrefixCache) -> int:
    """Write every cached block that is not on disk yet (parents first), within the disk budget.

    Called at shutdown, after the last step: the device and host copies stay as they are.
    """
    written, room = 0, cache.disk_free
    for root in cache.tree.roots():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            if not node.on_disk:
                if not node.disk_copy:  # written behind already: its file is current
                    if written >= room or not cache.mover.save(node):
                        continue  # a child without its parent on disk would be unreachable after a restart
                    written += 1
                for k in cache.ckpt.unsaved_of(node):  # hybrid models: its states without a file too (not
                    key = (node.digest, k)  # counted in the room: best effort, the run is over)
                    cache.ckpt.store.write_file(key, cache.ckpt.store.get(node.tier, key), index=False)
            stack.extend(node.children.values())
    log.info("conversation cache: %d blocks written to disk at shutdown", written,
             extra={"fields": {"written_blocks": written}})
    return written


def load_checkpoint_index(cache: PrefixCache) -> int:
    """Attach the checkpoint files found at start-up to the disk blocks they belong to (after
    load_disk_index), within the disk budget; the others are deleted. Returns checkpoints attached."""
    ckpt = cache.ckpt
    if not ckpt.enabled:
        return 0
    attached = 0
    keys, ckpt.store.on_disk = ckpt.store.scan(), set()  # indexed again as each one is kept
    for key in keys:
        node = cache.tiers.blocks("disk").get(key[0])
        fits = cache.disk_free >= ckpt.units  # the budget less blocks, copies and the files kept so far
        if node is None or not 0 < key[1] <= len(node.tokens) or not fits:
            ckpt.store.delete("disk", key)
            continue
        node.checkpoints.add(key[1])
        ckpt.store.on_disk.add(key)
        ckpt.nodes[id(node)] = node
        ckpt.on_change(node)
        attached += 1
    cache_log.info("conversation cache: %d state checkpoints loaded from disk", attached,
             extra={"fields": {"loaded_checkpoints": attached}})
    return attached
