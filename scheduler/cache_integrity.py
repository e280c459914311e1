"""The conversation cache's invariants, checked after every admission and step in tests."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.prefix_cache import PrefixCache


def check_cache(cache: "PrefixCache") -> None:
    """Per tier: free + cached (+ owned by running requests) == total; host committed within its budget;
    a block in one tier; pinned blocks on the device; tree links consistent; partial blocks are leaves; the
    eviction index equal to a full scan."""
    dev_free, host_free = cache._dev_free, cache._host_free
    dev_free.check_integrity()
    host_free.check_integrity()
    free, cached = dev_free.num_free, len(cache._on_device)
    assert dev_free.num_blocks == cache.num_blocks, "the device allocator and the pool size disagree"
    assert all(0 <= b < cache.num_blocks for b in cache._on_device), "a cached block beyond the pool's size"
    assert free + cached + cache._num_owned == cache.num_blocks, (
        f"device: free {free} + cached {cached} + in use {cache._num_owned} != total {cache.num_blocks}")
    committed = cache.admission.host_committed_blocks
    assert host_free.num_blocks == committed <= cache.host_blocks, "host tier committed counts disagree"
    assert host_free.num_free + len(cache._on_host) == committed, "host tier counts disagree"
    assert len(cache._on_disk) + len(cache._disk_copies) <= cache.disk_blocks, "disk tier over its budget"
    assert all(b.on_disk and d == b.digest for d, b in cache._on_disk.items())
    for digest, block in cache._disk_copies.items():  # written behind: resident, in the tree, with a file
        assert block.disk_copy and digest == block.digest and (block.on_device or block.on_host), "disk copy"
        assert block.parent is not None and block.parent.children.get(block.tokens) is block, "disk copy off the tree"
    for block in cache.unsaved.values():
        assert (block.on_device or block.on_host) and not block.disk_copy, "an unsaved block is not resident"
        assert block.parent is not None and block.parent.children.get(block.tokens) is block, "unsaved off the tree"
    assert not any(dev_free._is_free[b] for b in cache._on_device), "a block is both free and cached"
    assert not any(host_free._is_free[s] for s in cache._on_host), "a host slot is both free and cached"
    for tier, index in (("device", cache._on_device), ("host", cache._on_host)):
        for key, block in index.items():
            assert (block.device_id if tier == "device" else block.host_slot) == key
            assert block.parent is not None and block.parent.children.get(block.tokens) is block
            assert 0 < len(block.tokens) <= cache.block_size and block.ref_count >= 0
            assert not (block.ref_count and not block.on_device), "a pinned block is not on the device"
            assert not block.on_disk, "a block is in two tiers"
            assert block.disk_copy == (block.digest in cache._disk_copies), "disk copy flag and index disagree"
            assert not (block.on_device and block.on_host), "a block is in two tiers"
            assert len(block.tokens) == cache.block_size or not block.children, "partial block has children"
    for block in cache._on_disk.values():
        assert block.parent is not None and block.parent.children.get(block.tokens) is block
        assert not (block.on_device or block.on_host), "a block is in two tiers"
    cache.index.check(cache)  # the eviction order and counters against a full scan of the tiers
    cache.activity.check({*cache._on_device.values(), *cache._on_host.values(), *cache._on_disk.values()})
    _check_checkpoints(cache)


def _check_checkpoints(cache: "PrefixCache") -> None:
    """Hybrid models: every checkpoint is on a cached node, in its node's tier, with its bytes there; the
    tiers have room for the slots they take (device: with the requests' reservations; disk: with the
    written-behind copies, blocks' and checkpoints'); a checkpoint's file copy only beside its block's;
    the write-behind queue holds exactly the resident nodes with a checkpoint that has no file."""
    ckpt = cache.ckpt
    if not ckpt.enabled:
        assert not ckpt.nodes and not ckpt.reserved, "checkpoints on a model without recurrent state"
        return
    assert cache._dev_free.num_free >= ckpt.units_on("device"), (
        f"device: {cache._dev_free.num_free} free slots hold {ckpt.units_on('device')} of checkpoints")
    assert cache._host_free.num_free >= ckpt.units_on("host"), "host tier: checkpoints beyond its free slots"
    assert len(cache._on_disk) + len(cache._disk_copies) + ckpt.units_on("disk") <= cache.disk_blocks, (
        "disk tier: checkpoints beyond its budget")
    expected = {"device": set(), "host": set(), "disk": set()}
    index = {"device": cache._on_device, "host": cache._on_host, "disk": cache._on_disk}
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
