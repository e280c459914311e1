"""Where the conversation cache's blocks live: the device pool, host RAM and disk, and their allocators.

`Tiers` alone sets a block's residency (`device_id`, `host_slot`, `on_disk`, `disk_copy`) and keeps the
per-tier indexes and free lists; everything else reads them through its read-outs. Its moves are called
by `PrefixCache.apply` on the blocks a granted plan names (and, for the written-behind copies, by the
write-behind between the loop's decisions). A block's state checkpoints (hybrid models,
scheduler/cache/checkpoints.py) move with it: a spill writes only the states that have no file yet, a load
keeps their files as copies, and a block copy deleted for room takes its states' copies along.

    device  ids 0 .. num_blocks - 1:  free | cached (in the tree) | owned by running requests
    host    slots 0 .. committed - 1: free | cached (parked)        committed <= host_blocks (the budget)
    disk    files:                    disk-only blocks + written-behind copies (+ checkpoints) <= disk_blocks
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from engine.kv import BlockAllocator
from scheduler.cache.block_mover import BlockMover, BlockMoves
from scheduler.cache.checkpoints import Checkpoints
from scheduler.cache.eviction_index import EvictionIndex
from scheduler.cache.tree import CachedBlock


class Tiers:
    """Residency and allocators of the three tiers. Mutators change bookkeeping only; byte moves go into
    the `BlockMoves` they are given. `stats`: the cache's counters, which the moves count in."""

    def __init__(self, num_blocks: int, host_blocks: int, host_committed_blocks: int, disk_blocks: int,
                 ckpt: Checkpoints, index: EvictionIndex, mover: BlockMover, stats: dict[str, int]):
        self.host_blocks = host_blocks  # the host tier's budget; committed slots are the host allocator's
        self.disk_blocks = disk_blocks
        self.ckpt, self.index, self.mover, self.stats = ckpt, index, mover, stats
        self._num_blocks = num_blocks
        self._dev_free = BlockAllocator(num_blocks)
        self._host_free = BlockAllocator(host_committed_blocks)
        self._on_device: dict[int, CachedBlock] = {}
        self._on_host: dict[int, CachedBlock] = {}
        self._on_disk: dict[bytes, CachedBlock] = {}
        self._disk_copies: dict[bytes, CachedBlock] = {}  # resident blocks whose file is on disk too
        self._unsaved: dict[int, CachedBlock] = {}  # id -> resident block with no file yet (write-behind's queue)
        self._num_owned = 0  # device blocks handed to running requests, not yet in the tree
        self._indexes = {"device": self._on_device, "host": self._on_host, "disk": self._on_disk,
                         "copies": self._disk_copies}

    # -- read-outs (change nothing) ------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """The device pool's size: ids the cache hands out now (the elastic pool grows and shrinks it)."""
        return self._num_blocks

    @property
    def num_owned(self) -> int:
        return self._num_owned

    @property
    def unsaved(self) -> Mapping[int, CachedBlock]:
        """id -> resident block whose file is not written yet (the write-behind's queue)."""
        return MappingProxyType(self._unsaved)

    def blocks(self, tier: str) -> Mapping:
        """Cached blocks of `tier` by their place: device id, host slot, digest (disk), or digest for
        "copies" (resident blocks with a written-behind file). A read-only live view."""
        return MappingProxyType(self._indexes[tier])

    @property
    def num_cached(self) -> int:
        return len(self._on_device) + len(self._on_host) + len(self._on_disk)

    def free_ids(self, tier: str) -> list[int]:
        """Free device ids or host slots, in the order the allocator hands them out."""
        return (self._dev_free if tier == "device" else self._host_free).free_ids()

    def is_free(self, device_id: int) -> bool:
        return self._dev_free.is_free(device_id)

    def num_free_ids(self, tier: str) -> int:
        """Free device ids or committed host slots, before the checkpoints' share (`free_slots`)."""
        return (self._dev_free if tier == "device" else self._host_free).num_free

    def free_slots(self, tier: str) -> int:
        """Slots of `tier` no block and no checkpoint takes: the device's less the checkpoints it holds and
        those running requests reserved; committed host slots less the host checkpoints'; disk files left
        in the budget less disk-only blocks, written-behind copies and checkpoint files."""
        if tier == "disk":
            return self.disk_blocks - len(self._on_disk) - len(self._disk_copies) - self.ckpt.units_on("disk")
        return self.num_free_ids(tier) - self.ckpt.units_on(tier)

    def free_fractions(self) -> dict[str, float]:
        """Share of each tier free (the drop log closes its "tier full" episodes above 10%)."""
        return {"device": self._dev_free.num_free / max(1, self._num_blocks),
                "host": self._host_free.num_free / max(1, self.host_blocks),
                "disk": 1 - len(self._on_disk) / max(1, self.disk_blocks)}

    # -- the device pool -----------------------------------------------------------------------------
    def allocate_owned(self, count: int) -> list[int]:
        """`count` free device ids for a running request (there are: its plan made the room)."""
        ids = self._dev_free.allocate(count)
        self._num_owned += len(ids)
        return ids

    def disown(self, device_id: int, cached: bool) -> None:
        """A released request's block: it joins the tree next (`cached`, then `place` or `free_device`
        takes it) or goes back to the free list now."""
        self._num_owned -= 1
        if not cached:
            self._dev_free.free([device_id])

    def free_device(self, device_id: int) -> None:
        """A released block whose content the tree holds on the device already: its id is free again."""
        self._dev_free.free([device_id])

    def place(self, block: CachedBlock, device_id: int) -> None:
        """`block` lives in device block `device_id` from now on (restored, loaded, or released into the tree)."""
        block.device_id = device_id
        self._on_device[device_id] = block

    def restore_target(self) -> int:
        """A free device id for a block coming back from a lower tier."""
        return self._dev_free.allocate(1)[0]

    def grow_device(self, count: int) -> int:
        """New ids at the top of the pool, free. Returns the pool's size."""
        self._dev_free.grow(count)
        self._num_blocks += count
        return self._num_blocks

    def relocate(self, block: CachedBlock, new_id: int, moves: BlockMoves) -> None:
        """A cached block moves down to a free id (the pool shrinks over its old one)."""
        self._dev_free.take(new_id)
        moves.copies.append((block.device_id, new_id))
        del self._on_device[block.device_id]
        self._dev_free.free([block.device_id])
        self.place(block, new_id)
        self.index.sync(block)

    def shrink_device(self, num_blocks: int) -> int:
        """Give back the ids from num_blocks up (all free). Returns the old size."""
        self._dev_free.shrink(num_blocks)
        old, self._num_blocks = self._num_blocks, num_blocks
        return old

    def take_over(self, source: CachedBlock) -> int:
        """A cached device block becomes a request's own (it left the tree): its id, owned now; its file goes."""
        del self._on_device[source.device_id]
        self._unsaved.pop(id(source), None)
        if source.disk_copy:
            del self._disk_copies[source.digest]
            self.mover.delete_disk(source)
        self._num_owned += 1
        return source.device_id

    # -- host RAM ------------------------------------------------------------------------------------
    def grow_host(self, count: int) -> int:
        """Commit `count` more host slots. Returns the slots committed in all."""
        self._host_free.grow(count)
        return self._host_free.num_blocks

    def leave_host(self, block: CachedBlock, with_states: bool = True) -> int:
        """`block` leaves host RAM for the device (`with_states`: its checkpoints go there too). Its slot."""
        if with_states:
            self.ckpt.move(block, "host", "device")
        slot = block.host_slot
        self._host_free.free([slot])
        del self._on_host[slot]
        block.host_slot = -1
        return slot

    def park(self, block: CachedBlock, moves: BlockMoves) -> None:
        """Device -> host RAM, with its checkpoints (a free committed slot is there: the plan made it)."""
        slot = self._host_free.allocate(1)[0]
        self.ckpt.move(block, "device", "host")
        moves.parks.append((block.device_id, slot))
        del self._on_device[block.device_id]
        self._dev_free.free([block.device_id])
        block.device_id, block.host_slot = -1, slot
        self._on_host[slot] = block
        self.index.sync(block)
        self.stats["parks"] += 1

    # -- disk ----------------------------------------------------------------------------------------
    def load(self, block: CachedBlock, device_id: int, payloads: dict, moves: BlockMoves, keep_source: bool,
             checkpoint_loads: dict | None = None) -> None:
        """Fill `device_id` with a host or disk block's bytes. `keep_source` (a copy-on-write source): the
        block stays where it is; else it leaves its tier (the caller places it on the device)."""
        if block.on_host:
            moves.restores.append((block.host_slot, device_id))
            if not keep_source:
                self.leave_host(block)
            return
        moves.writes.append((device_id, payloads[id(block)]))
        self.stats["disk_loads"] += 1
        if not keep_source:  # the file stays as the resident block's copy: nothing to write back later
            self.ckpt.load(block, (checkpoint_loads or {}).get(id(block), {}))  # so do its states' files
            del self._on_disk[block.digest]
            block.on_disk, block.disk_copy = False, True
            self._disk_copies[block.digest] = block

    def spill(self, block: CachedBlock, moves: BlockMoves) -> None:
        """To the disk tier, from wherever it is now (a block this plan would have parked goes straight).
        A block written behind already has its file: it only leaves its resident tier (so do its
        checkpoints; those without a file get one now)."""
        self.ckpt.spill(block, block.tier)
        written = block.disk_copy
        if written:
            del self._disk_copies[block.digest]
            block.disk_copy = False
        if block.on_device:
            if not written:
                moves.saves.append((block, "device", block.device_id))
            del self._on_device[block.device_id]
            self._dev_free.free([block.device_id])
            block.device_id = -1
        else:
            if not written:
                moves.saves.append((block, "host", block.host_slot))
            self._host_free.free([block.host_slot])
            del self._on_host[block.host_slot]
            block.host_slot = -1
        block.on_disk = True
        self._on_disk[block.digest] = block
        self._unsaved.pop(id(block), None)
        self.index.sync(block)
        self.stats["spills"] += 1

    def add_disk_block(self, node: CachedBlock) -> None:
        """A block found on disk at start-up (already linked into the tree)."""
        node.on_disk = True
        self._on_disk[node.digest] = node

    def record_disk_copy(self, block: CachedBlock) -> None:
        """A resident block's file was just written: it needs no write when spilled or at shutdown."""
        assert (block.on_device or block.on_host) and not block.disk_copy and self.free_slots("disk") > 0
        del self._unsaved[id(block)]
        block.disk_copy = True
        self._disk_copies[block.digest] = block
        self.index.sync(block)

    def forget_disk_copy(self, block: CachedBlock) -> None:
        """Delete a resident block's file (and its checkpoints' files) for room; the block stays and is
        written again later."""
        self.ckpt.forget_copies(block)
        del self._disk_copies[block.digest]
        block.disk_copy = False
        self.mover.delete_disk(block)
        self._unsaved[id(block)] = block
        self.index.sync(block)

    # -- blocks joining and leaving the tree ---------------------------------------------------------
    def replace_parked(self, existing: CachedBlock) -> None:
        """A parked block whose content a released device copy replaces leaves host RAM; a disk one's file
        holds these very bytes, so it stays, as the fresh copy's file. Its states were handled before."""
        if existing.on_host:
            self.leave_host(existing, with_states=False)
        if existing.on_disk:
            del self._on_disk[existing.digest]
            existing.on_disk, existing.disk_copy = False, True
            self._disk_copies[existing.digest] = existing

    def queue_unsaved(self, block: CachedBlock) -> None:
        """A block that joined the tree on the device: with a disk tier, queued for the write-behind."""
        if self.disk_blocks and not block.disk_copy:
            self._unsaved[id(block)] = block

    def drop(self, node: CachedBlock) -> None:
        """`node` leaves every tier (dropped): its checkpoints, its slot, its files."""
        self.ckpt.drop(node)
        if node.on_device:
            del self._on_device[node.device_id]
            self._dev_free.free([node.device_id])
        if node.on_host:
            del self._on_host[node.host_slot]
            self._host_free.free([node.host_slot])
        if node.on_disk:
            del self._on_disk[node.digest]
            self.mover.delete_disk(node)
        if node.disk_copy:
            del self._disk_copies[node.digest]
            self.mover.delete_disk(node)
        self._unsaved.pop(id(node), None)
        node.device_id, node.host_slot, node.on_disk, node.disk_copy = -1, -1, False, False

    # -- integrity -----------------------------------------------------------------------------------
    def check(self, host_committed_blocks: int) -> None:
        """Per tier: free + cached (+ owned by running requests) == total; host committed within its
        budget (and equal to the admission's `host_committed_blocks`); no id both free and cached."""
        dev_free, host_free = self._dev_free, self._host_free
        dev_free.check_integrity()
        host_free.check_integrity()
        free, cached, owned, total = dev_free.num_free, len(self._on_device), self._num_owned, self._num_blocks
        assert dev_free.num_blocks == total, "the device allocator and the pool size disagree"
        assert all(0 <= b < total for b in self._on_device), "a cached block beyond the pool's size"
        assert free + cached + owned == total, f"device: free {free} + cached {cached} + in use {owned} != total {total}"
        assert host_free.num_blocks == host_committed_blocks <= self.host_blocks, "host tier committed counts disagree"
        assert host_free.num_free + len(self._on_host) == host_committed_blocks, "host tier counts disagree"
        assert len(self._on_disk) + len(self._disk_copies) <= self.disk_blocks, "disk tier over its budget"
        assert not any(dev_free.is_free(b) for b in self._on_device), "a block is both free and cached"
        assert not any(host_free.is_free(s) for s in self._on_host), "a host slot is both free and cached"
