"""A parked node's checkpoints when a released request's device copy of the same tokens replaces it.

A request that recomputed (or copied) a block whose content is also parked in the host or disk tier
releases its device copy into the tree in place of the parked one (scheduler/cache/apply.py `_insert`:
one copy of each content, the resident one). The parked node's checkpoints sit in the lower tier, whose
block slot the replacement gives back. Before, they were forgotten; a trimmed history's system-message
boundary went so every other turn (tiny qwen3next under --pressure: re-reads of 166 of 166 tokens). Now
they come up to the device with their node where the device has free slots for them, the most useful
first (`park_order`, the rule a park keeps them by); only those without room are forgotten.
The free slots are those no block and no checkpoint (held or reserved by a running request) takes, so
the release's own reserved checkpoints still find theirs.
"""
from __future__ import annotations

from scheduler.cache.checkpoint_spacing import most_useful
from scheduler.cache.checkpoints import Checkpoints
from scheduler.cache.tree import CachedBlock


def park_order(ckpt: Checkpoints, node: CachedBlock) -> list[int]:
    """The node's checkpoints (k), the most useful first. On a tip (a node without children: where a
    conversation's last turn ended) the last state comes first: the next turn goes on from it, and a tier
    with room for one state would otherwise keep one before it (a reply of 2-4 tokens left the reply-end
    state the smallest gap, after the prompt-end's; tiny qwen3next under --pressure then recomputed every
    turn from the tip block's first state, docs/BENCHMARKS.md issue 28). The others: the one whose loss
    costs least recompute (the smallest gap to the one before it on the path, `Checkpoints.gap` for the
    first) goes first, the earlier on a tie, gaps counted again after each goes
    (checkpoint_spacing.most_useful). A park keeps them in this order as the host tier has room
    (scheduler/cache/room.py); an adoption as the device has."""
    if not node.checkpoints:
        return []
    first = min(node.checkpoints)
    order = most_useful(node.checkpoints, first - ckpt.gap(node, first), ())
    if node.children:
        return order
    last = max(node.checkpoints)
    return [last] + [k for k in order if k != last]


def adopt_parked_states(ckpt: Checkpoints, node: CachedBlock, free_device_slots: int) -> None:
    """Call while `node` (host or disk) is still in its tier, before it becomes the device copy: its
    states that fit the device's free slots move there (a disk one is read, its file stays as the
    copy, as a loaded block's does); the rest, and any whose file is unreadable, are forgotten."""
    if not node.checkpoints:
        return
    room = max(0, free_device_slots // ckpt.units)  # free_device_slots: Tiers.free_slots("device")
    order = park_order(ckpt, node)
    for k in order[room:][::-1]:  # no room on the device: the least useful go
        ckpt.forget(node, k)
    tier, store = node.tier, ckpt.store
    for k in order[:room]:
        key = (node.digest, k)
        if tier == "host":
            store.move(key, "host", "device")
            continue
        state = store.read_file(key)
        if state is None:
            ckpt.forget(node, k)
        else:
            store.keep_as_copy(key, state)  # `unsaved` needs no change: a host node's states keep
            # their files or lack of them; a disk node's all have files now
