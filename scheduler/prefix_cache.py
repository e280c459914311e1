"""The conversation cache: token-exact longest-prefix reuse over a tree of KV blocks, in two tiers.

Full blocks are shared in place; a prompt that diverges or ends inside a block reuses that block's
matching tokens by copy-on-write into a block the request owns, so a shared block is never written.
Many variants of a conversation coexist as branches (a toggling tool list hits both).

    root ── [sys prompt 0:16] ── [16:32] ── [32:48 turn 1] ── [48:57 reply tail, partial]
                                        └── [32:48 other conversation] ...

Tiers: the device pool the model computes in, and host RAM reserved at start-up. When the device needs
room, the least valuable unpinned block (a leaf of what is on the device; superseded branches first,
then least recently used) is parked in host RAM; only when the host tier is full too is the least
valuable host leaf dropped, and every drop is logged with its conversation. A hit on parked blocks
restores them. Blocks pinned by running requests never move. Nothing is decided before it is known to
succeed: `allocate` checks that room can be made before parking anything, and returns None untouched.
The moves are returned as copy lists the engine performs between steps: parks, then restores, then copies.
"""
from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.kv import BlockAllocator
from scheduler.block_mover import BlockMover, RecordingMover
from scheduler.cache_tiers import TierMoves
from scheduler.cache_tree import (CachedBlock, PrefixMatch, block_digest, common_prefix_len, conversation_id,
                                  longest_match, root_digest)
from scheduler.memory_admission import MemoryAdmission

log = logging.getLogger("strata.cache")


@dataclass
class Allocation:
    """A request's block table (shared cached blocks first, then its own) and the copies to run first."""

    block_table: list[int]
    num_shared: int
    cached_tokens: int
    reused_by_tier: dict[str, int] = field(default_factory=dict)
    salt: str = ""
    parks: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device block, device block)


class PrefixCache(TierMoves):
    """Owns every device block id and host slot: free, cached (unpinned) or in use (pinned / owned)."""

    def __init__(self, num_blocks: int, block_size: int, enabled: bool = True, host_blocks: int = 0,
                 disk_blocks: int = 0, mover: BlockMover | None = None, block_bytes: int = 0,
                 admission: MemoryAdmission | None = None):
        self.enabled = enabled  # off: nothing is ever matched or kept (the reference for tests)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.host_blocks = host_blocks  # the host tier's budget; admission.host_committed_blocks are usable now
        self.admission = admission or MemoryAdmission(host_blocks, block_bytes)
        assert self.admission.host_budget_blocks == host_blocks, "the cache and its admission disagree on the host budget"
        self._dev_free = BlockAllocator(num_blocks)
        self._host_free = BlockAllocator(self.admission.host_committed_blocks)
        self._roots: dict[str, CachedBlock] = {}
        self._roots_by_digest: dict[bytes, CachedBlock] = {}
        self._dropped: OrderedDict[bytes, tuple[float, str, str]] = OrderedDict()  # digest -> when, tier, why
        self._on_device: dict[int, CachedBlock] = {}
        self._on_host: dict[int, CachedBlock] = {}
        self._on_disk: dict[bytes, CachedBlock] = {}
        self.disk_blocks = disk_blocks
        self.mover = mover or RecordingMover()
        self.block_bytes = block_bytes  # for the "budget full" message only
        self._full_episode: dict[str, int] = {}  # tier -> blocks dropped since it filled up
        self._clock = itertools.count(1)
        self._num_owned = 0  # device blocks handed to running requests, not yet in the tree
        self.stats = {"parks": 0, "restores": 0, "spills": 0, "disk_loads": 0, "dropped_blocks": 0,
                      "dropped_tokens": 0, "hits": 0, "misses": 0, "miss_diverged": 0, "miss_evicted": 0}

    # -- queries -------------------------------------------------------------------------------------
    def match(self, token_ids: list[int], max_tokens: int | None = None, salt: str = "") -> PrefixMatch:
        """Longest cached prefix, at most max_tokens long (callers pass len - 1 so the last prompt token is
        always computed), among blocks cached under the same salt. Changes nothing."""
        limit = min(len(token_ids), len(token_ids) if max_tokens is None else max_tokens)
        match = longest_match(self._root(salt), token_ids, limit if self.enabled else 0, self.block_size)
        match.salt = salt
        return match

    def explain_miss(self, token_ids: list[int], match: PrefixMatch) -> dict | None:
        """Why a prompt reused no more than `match`, when the cache once held more of it: the position where
        it diverged from a cached sequence, or the eviction that took the rest. None for new content."""
        self.stats["hits" if match.num_tokens else "misses"] += 1
        miss = self._explain(token_ids, match)
        if miss is not None:
            self.stats["miss_" + miss["cause"]] += 1
        return miss

    def _explain(self, token_ids: list[int], match: PrefixMatch) -> dict | None:
        B, pos = self.block_size, match.num_tokens
        node = match.shared[-1] if match.shared else self._root(match.salt)
        block_start = len(match.shared) * B
        next_block = token_ids[block_start : block_start + B]
        if len(next_block) == B:
            dropped = self._dropped.get(block_digest(node.digest, next_block))
            if dropped is not None:
                when, tier, reason = dropped
                return {"cause": "evicted", "position": block_start, "evicted_at": when, "tier": tier,
                        "reason": reason}
        if node.children and pos < len(token_ids) - 1:
            nearest = max(node.children.values(), key=lambda c: common_prefix_len(c.tokens, next_block))
            if len(nearest.tokens) > common_prefix_len(nearest.tokens, next_block):
                return {"cause": "diverged", "position": block_start + common_prefix_len(nearest.tokens, next_block),
                        "conversation": conversation_id(nearest)}
        return None

    @property
    def num_free(self) -> int:
        """Device blocks obtainable now: never-used plus unpinned cached ones (which can be moved off)."""
        return self._dev_free.num_free + sum(1 for b in self._on_device.values() if b.ref_count == 0)

    @property
    def num_cached(self) -> int:
        return len(self._on_device) + len(self._on_host) + len(self._on_disk)

    def usage(self) -> dict[str, int]:
        return {"device_cached": len(self._on_device), "device_in_use": self._num_owned
                + sum(1 for b in self._on_device.values() if b.ref_count), "device_total": self.num_blocks,
                "host_cached": len(self._on_host), "host_total": self.host_blocks,
                **self.admission.snapshot(len(self._on_host)),
                "disk_cached": len(self._on_disk), "disk_total": self.disk_blocks, **self.stats,
                "moves": getattr(self.mover, "totals", {})}

    # -- mutations -----------------------------------------------------------------------------------
    def allocate(self, match: PrefixMatch, total_tokens: int) -> Allocation | None:
        """Pin the matched blocks (restoring parked ones) and reserve fresh blocks up to total_tokens.

        Returns None, with nothing changed, when the device cannot make room without moving pinned blocks.
        """
        self._end_full_episodes()
        payloads = self._read_disk_blocks(match)  # first, so an unreadable file only shortens the match
        fresh_count = -(-total_tokens // self.block_size) - len(match.shared)
        to_restore = [b for b in match.shared if not b.on_device]
        pinned = match.shared + ([match.cow_source] if match.cow_source is not None else [])
        for block in pinned:
            self._pin(block)
        alloc = Allocation([], len(match.shared), match.num_tokens, salt=match.salt)
        movable = sum(1 for b in self._on_device.values() if b.ref_count == 0)
        if self._dev_free.num_free + movable < fresh_count + len(to_restore):
            for block in pinned:
                self._unpin(block)
            source = match.cow_source
            if source is not None and source.on_device:
                # The copy source occupies a block this request needs: take it over when nobody else can
                # want it (unpinned leaf), else give up its few tokens rather than wait forever.
                if source.ref_count == 0 and not source.children:
                    return self._allocate_taking_over(match, total_tokens)
                return self.allocate(PrefixMatch(match.shared, None, 0, match.salt), total_tokens)
            return None
        self._make_device_room(fresh_count + len(to_restore), alloc)
        self._count_reuse(alloc, match, to_restore)
        for block in to_restore:  # move back to the device; the lower tier's copy is released
            block.device_id = self._dev_free.allocate(1)[0]
            self._load(block, block.device_id, payloads, alloc, keep_source=False)
            self._on_device[block.device_id] = block
        fresh = self._dev_free.allocate(fresh_count)
        self._num_owned += fresh_count
        alloc.block_table = [b.device_id for b in match.shared] + fresh
        source = match.cow_source
        if source is not None:
            if source.on_device:
                alloc.copies.append((source.device_id, fresh[0]))
                self.mover.copy(source.device_id, fresh[0])
            else:
                self._load(source, fresh[0], payloads, alloc, keep_source=True)
            self._unpin(source)
        self.stats["restores"] += len(alloc.restores)
        return alloc

    def _allocate_taking_over(self, match: PrefixMatch, total_tokens: int) -> Allocation | None:
        """Allocate with the partial-hit block itself as the request's first own block: no copy, and its
        matching tokens stay valid in place (the rest is overwritten as the request computes)."""
        source = match.cow_source
        del source.parent.children[source.tokens]
        del self._on_device[source.device_id]
        alloc = self.allocate(PrefixMatch(match.shared, None, 0, match.salt), total_tokens - self.block_size)
        if alloc is None:  # put it back exactly as it was
            source.parent.children[source.tokens] = source
            self._on_device[source.device_id] = source
            return None
        self._num_owned += 1
        alloc.block_table.insert(len(match.shared), source.device_id)
        alloc.cached_tokens += match.cow_tokens
        alloc.reused_by_tier["device"] += match.cow_tokens
        return alloc

    def _read_disk_blocks(self, match: PrefixMatch) -> dict[int, object]:
        """Bytes of the matched blocks that live only on disk; cuts the match at the first unreadable one."""
        payloads = {}
        for i, block in enumerate(match.shared):
            if block.on_device or block.on_host:
                continue
            payload = self.mover.read_disk(block)
            if payload is None:
                self._drop(block, "disk", "block file missing or corrupt")
                match.shared, match.cow_source, match.cow_tokens = match.shared[:i], None, 0
                return payloads
            payloads[id(block)] = payload
        source = match.cow_source
        if source is not None and not (source.on_device or source.on_host):
            payload = self.mover.read_disk(source)
            if payload is None:
                self._drop(source, "disk", "block file missing or corrupt")
                match.cow_source, match.cow_tokens = None, 0
            else:
                payloads[id(source)] = payload
        return payloads

    def _load(self, block: CachedBlock, device_id: int, payloads: dict, alloc: Allocation, keep_source: bool):
        if block.on_host:
            alloc.restores.append((block.host_slot, device_id))
            self.mover.restore(block.host_slot, device_id)
            if not keep_source:
                self._host_free.free([block.host_slot])
                del self._on_host[block.host_slot]
                block.host_slot = -1
            return
        self.mover.write_device(device_id, payloads[id(block)])
        alloc.restores.append((-1, device_id))
        self.stats["disk_loads"] += 1
        if not keep_source:
            self.mover.delete_disk(block)
            del self._on_disk[block.digest]
            block.on_disk = False

    def release(self, token_ids: list[int], num_computed: int, allocation: Allocation) -> None:
        """A request is done: its computed tokens' blocks join the tree (unpinned), the rest are freed."""
        node = self._root(allocation.salt)
        for i, device_id in enumerate(allocation.block_table):
            start = i * self.block_size
            tokens = tuple(token_ids[start : min(start + self.block_size, num_computed)])
            if i < allocation.num_shared:
                node = self._on_device[device_id]
                self._unpin(node)
                continue
            self._num_owned -= 1
            if not tokens or not self.enabled:
                self._dev_free.free([device_id])
                continue
            node = self._insert(node, tokens, device_id)

    def check_integrity(self) -> None:
        """Per tier: free + cached (+ owned) == total; tree links consistent; pinned blocks on device."""
        self._dev_free.check_integrity()
        self._host_free.check_integrity()
        free, cached = self._dev_free.num_free, len(self._on_device)
        assert free + cached + self._num_owned == self.num_blocks, (
            f"device: free {free} + cached {cached} + in use {self._num_owned} != total {self.num_blocks}")
        committed = self.admission.host_committed_blocks
        assert self._host_free.num_blocks == committed <= self.host_blocks, "host tier committed counts disagree"
        assert self._host_free.num_free + len(self._on_host) == committed, "host tier counts disagree"
        assert len(self._on_disk) <= self.disk_blocks, "disk tier over its budget"
        assert all(b.on_disk and d == b.digest for d, b in self._on_disk.items())
        assert not any(self._dev_free._is_free[b] for b in self._on_device), "a block is both free and cached"
        for tier, index in (("device", self._on_device), ("host", self._on_host)):
            for key, block in index.items():
                assert (block.device_id if tier == "device" else block.host_slot) == key
                assert block.parent is not None and block.parent.children.get(block.tokens) is block
                assert 0 < len(block.tokens) <= self.block_size and block.ref_count >= 0
                assert not (block.ref_count and not block.on_device), "a pinned block is not on the device"
                assert not block.on_disk, "a block is in two tiers"
                assert len(block.tokens) == self.block_size or not block.children, "partial block has children"
        assert len({id(b) for b in self._on_device.values()} & {id(b) for b in self._on_host.values()}) == 0

    # -- internals -----------------------------------------------------------------------------------
    def _root(self, salt: str) -> CachedBlock:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = self._root_for_digest(root_digest(salt))
        return root

    def _root_for_digest(self, digest: bytes) -> CachedBlock:
        """The root node with this digest (created on first use, e.g. by blocks loaded from disk)."""
        root = self._roots_by_digest.get(digest)
        if root is None:
            root = self._roots_by_digest[digest] = CachedBlock((), None, digest=digest)
        return root

    def _insert(self, parent: CachedBlock, tokens: tuple[int, ...], device_id: int) -> CachedBlock:
        existing = parent.children.get(tokens)
        if existing is not None and existing.on_device:  # same content already cached: keep one copy
            self._dev_free.free([device_id])
            existing.last_used = next(self._clock)
            return existing
        if existing is not None:  # parked copy of the same content: the fresh device copy replaces it
            if existing.on_host:
                self._host_free.free([existing.host_slot])
                del self._on_host[existing.host_slot]
                existing.host_slot = -1
            if existing.on_disk:
                self.mover.delete_disk(existing)
                del self._on_disk[existing.digest]
                existing.on_disk = False
            block = existing
        else:
            block = CachedBlock(tokens, parent, digest=block_digest(parent.digest, tokens))
            parent.children[tokens] = block
        block.device_id, block.last_used = device_id, next(self._clock)
        self._on_device[device_id] = block
        return block

    def _pin(self, block: CachedBlock) -> None:
        block.ref_count += 1
        block.last_used = next(self._clock)

    def _unpin(self, block: CachedBlock) -> None:
        assert block.ref_count > 0, "block unpinned more often than pinned"
        block.ref_count -= 1
        block.last_used = next(self._clock)

    def _count_reuse(self, alloc: Allocation, match: PrefixMatch, restored: list[CachedBlock]) -> None:
        """Reused tokens by the tier they came from (called before anything is moved back)."""
        parts = [(b, len(b.tokens)) for b in restored]
        if match.cow_source is not None and not match.cow_source.on_device:
            parts.append((match.cow_source, match.cow_tokens))
        host = sum(n for b, n in parts if b.on_host)
        disk = sum(n for b, n in parts if not b.on_host)
        alloc.reused_by_tier = {"device": match.num_tokens - host - disk, "host": host, "disk": disk}
