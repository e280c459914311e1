"""The conversation cache's invariants, checked after every admission and step in tests.

Reads the parts through their public read-outs only (`Tiers.blocks`, `free_slots`, ...); each part checks
its own private state (`Tiers.check`, `EvictionIndex.check`, `ConversationActivity.check`).
"""
from __future__ import annotations

from scheduler.cache.checkpoints import Checkpoints
from scheduler.cache.conversation_activity import ConversationActivity
from scheduler.cache.eviction_index import EvictionIndex
from scheduler.cache.tiers import Tiers
from scheduler.cache.tree import CachedBlock


def check_cache(tiers: Tiers, index: EvictionIndex, activity: ConversationActivity, ckpt: Checkpoints,
                host_committed_blocks: int, block_size: int) -> None:
    """Per tier: free + cached (+ owned by running requests) == total; host committed within its budget;
    a block in one tier; pinned blocks on the device; tree links consistent; partial blocks are leaves; the
    eviction index equal to a full scan."""
    tiers.check(host_committed_blocks)
    on_device, on_host, on_disk, copies = (tiers.blocks(t) for t in ("device", "host", "disk", "copies"))
    assert all(b.on_disk and d == b.digest for d, b in on_disk.items())
    for digest, block in copies.items():  # written behind: resident, in the tree, with a file
        assert block.disk_copy and digest == block.digest and (block.on_device or block.on_host), "disk copy"
        assert _linked(block), "disk copy off the tree"
    for block in tiers.unsaved.values():
        assert (block.on_device or block.on_host) and not block.disk_copy, "an unsaved block is not resident"
        assert _linked(block), "unsaved off the tree"
    for tier, blocks in (("device", on_device), ("host", on_host)):
        for key, block in blocks.items():
            assert (block.device_id if tier == "device" else block.host_slot) == key
            assert _linked(block)
            assert 0 < len(block.tokens) <= block_size and block.ref_count >= 0
            assert not (block.ref_count and not block.on_device), "a pinned block is not on the device"
            assert not block.on_disk, "a block is in two tiers"
            assert block.disk_copy == (block.digest in copies), "disk copy flag and index disagree"
            assert not (block.on_device and block.on_host), "a block is in two tiers"
            assert len(block.tokens) == block_size or not block.children, "partial block has children"
    for block in on_disk.values():
        assert _linked(block)
        assert not (block.on_device or block.on_host), "a block is in two tiers"
    cached = [*on_device.values(), *on_host.values(), *on_disk.values()]
    index.check(cached)  # the eviction order and counters against a full scan of the tiers
    activity.check(set(cached))
    _check_checkpoints(tiers, ckpt)


def _linked(block: CachedBlock) -> bool:
    return block.parent is not None and block.parent.children.get(block.tokens) is block


def _check_checkpoints(tiers: Tiers, ckpt: Checkpoints) -> None:
    """Hybrid models: every checkpoint is on a cached node, in its node's tier, with its bytes there; the
    tiers have room for the slots they take (device: with the requests' reservations; disk: with the
    written-behind copies, blocks' and checkpoints'); a checkpoint's file copy only beside its block's;
    the write-behind queue holds exactly the resident nodes with a checkpoint that has no file."""
    if not ckpt.enabled:
        assert not ckpt.nodes and not ckpt.reserved, "checkpoints on a model without recurrent state"
        return
    device_free = tiers.num_free_ids("device")
    assert tiers.free_slots("device") >= 0, (
        f"device: {device_free} free slots hold {ckpt.units_on('device')} of checkpoints")
    assert tiers.free_slots("host") >= 0, "host tier: checkpoints beyond its free slots"
    assert tiers.free_slots("disk") >= 0, "disk tier: checkpoints beyond its budget"
    expected = {"device": set(), "host": set(), "disk": set()}
    index = {"device": tiers.blocks("device"), "host": tiers.blocks("host"), "disk": tiers.blocks("disk")}
    for node in ckpt.nodes.values():
        key = node.device_id if node.on_device else node.host_slot if node.on_host else node.digest
        assert index[node.tier].get(key) is node, f"checkpointed node not cached in the {node.tier} tier"
        assert node.checkpoints and all(0 < k <= len(node.tokens) for k in node.checkpoints), node.checkpoints
        expected[node.tier] |= {(node.digest, k) for k in node.checkpoints}
    carried = sum(1 for idx in index.values() for node in idx.values() if node.checkpoints)
    assert carried == len(ckpt.nodes), "a node carries checkpoints the cache does not know of"
    store = ckpt.store
    assert set(store.tiers["device"]) == expected["device"], "device checkpoint bytes disagree with the tree"
    assert set(store.tiers["host"]) == expected["host"], "host checkpoint bytes disagree with the tree"
    assert store.on_disk == expected["disk"], "checkpoint files disagree with the tree"
    resident = expected["device"] | expected["host"]
    assert store.copies <= resident, "a checkpoint file copy of no resident checkpoint"
    copied = {id(n) for n in ckpt.nodes.values() if ckpt.copies_on(n)}
    assert all(ckpt.nodes[i].disk_copy for i in copied), "a checkpoint's file copy without its block's"
    unsaved = {id(n) for n in ckpt.nodes.values() if not n.on_disk and ckpt.unsaved_of(n)}
    assert set(ckpt.unsaved) == (unsaved if store.dir is not None else set()), "checkpoint write-behind queue"
    for tier in ("device", "host", "disk"):  # units_on reads the store's counts: the tree's, by the above
        assert ckpt.count(tier) == sum(len(n.checkpoints) for n in ckpt.nodes.values() if n.tier == tier), tier
