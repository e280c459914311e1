"""The conversation cache: token-exact longest-prefix reuse over a tree of KV blocks, in three tiers.

Full blocks are shared in place; a prompt that diverges or ends inside a block reuses that block's
matching tokens by copy-on-write into a block the request owns, so a shared block is never written.
Many variants of a conversation coexist as branches (a toggling tool list hits both).

    root ── [sys prompt 0:16] ── [16:32] ── [32:48 turn 1] ── [48:57 reply tail, partial]
                                        └── [32:48 other conversation] ...

Tiers: the device pool the model computes in, host RAM (a budget committed as parks need it) and disk.
Decide, grant, apply: `plan_allocate` / `plan_extend` / `plan_release` return a Plan (cache_plan.py) and
change nothing; the memory admission grants it whole or refuses it; `apply` then changes the tree and the
tiers and hands the byte moves to the mover in one call (parks, restores, loads, copies; spills first).
Loads from the lower tiers, spills and the written-behind disk copies are in scheduler/cache_disk.py.
`allocate` / `extend` / `release` do the three steps for callers that have no admission of their own.
Blocks pinned by running requests never move; every drop is logged with its conversation.
"""
from __future__ import annotations

import itertools
import logging

from engine.kv import BlockAllocator, blocks_needed
from scheduler.block_mover import BlockMover, BlockMoves, RecordingMover
from scheduler import cache_disk, checkpoint_adopt
from scheduler.cache_allocation import Allocation, read_disk_blocks, reuse_by_tier
from scheduler.cache_drops import DropLog
from scheduler.cache_explain import explain_miss
from scheduler.cache_integrity import check_cache
from scheduler.cache_plan import Plan, plan_device_room
from scheduler.cache_tree import CachedBlock, PrefixMatch, block_digest, conversation_id, longest_match, root_digest
from scheduler.checkpoints import Checkpoints
from scheduler.conversation_activity import ACTIVE_WINDOW_S, ConversationActivity
from scheduler.eviction_index import EvictionIndex
from scheduler.device_pool import apply_growth, apply_shrink, plan_shrink
from scheduler.memory.admission import MemoryAdmission

log = logging.getLogger("strata.cache")
__all__ = ["Allocation", "PrefixCache"]


class PrefixCache:
    """Owns every device block id and host slot: free, cached (unpinned) or in use (pinned / owned)."""

    def __init__(self, num_blocks: int, block_size: int, enabled: bool = True, host_blocks: int = 0,
                 disk_blocks: int = 0, mover: BlockMover | None = None, block_bytes: int = 0,
                 admission: MemoryAdmission | None = None, active_window_s: float = ACTIVE_WINDOW_S,
                 checkpoints: Checkpoints | None = None):
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
        self._on_device: dict[int, CachedBlock] = {}
        self._on_host: dict[int, CachedBlock] = {}
        self._on_disk: dict[bytes, CachedBlock] = {}
        self._disk_copies: dict[bytes, CachedBlock] = {}  # resident blocks whose file is on disk too
        self.unsaved: dict[int, CachedBlock] = {}  # id -> resident block with no file yet (write-behind's queue)
        self.disk_blocks = disk_blocks
        self.mover = mover or RecordingMover()
        self.drops = DropLog(block_bytes)
        self._clock = itertools.count(1)
        self._num_owned = 0  # device blocks handed to running requests, not yet in the tree
        self.ckpt = checkpoints or Checkpoints()  # hybrid models: recurrent-state checkpoints on the nodes
        # Every change to a cached block is followed by index.sync(block): the eviction order, kept as it goes.
        # A block's weight is the device slots it frees: 1, plus its checkpoints' (hybrid models).
        self.activity = ConversationActivity(active_window_s, on_change=lambda blocks: self.index.resync(blocks))
        self.index = EvictionIndex(block_size, self.activity.is_active, weight=self.ckpt.weight)
        self.ckpt.on_change = self.index.sync  # a node's checkpoints came or went: its weight changed
        self.stats = {"parks": 0, "restores": 0, "spills": 0, "disk_loads": 0, "dropped_blocks": 0,
                      "dropped_tokens": 0, "hits": 0, "misses": 0, "miss_diverged": 0, "miss_evicted": 0,
                      "refused_plans": 0, "device_grows": 0, "device_shrinks": 0, "miss_no_checkpoint": 0,
                      "state_windows": 0}

    # -- queries -------------------------------------------------------------------------------------
    def match(self, token_ids: list[int], max_tokens: int | None = None, salt: str = "",
              conversation: str | None = None) -> PrefixMatch:
        """Longest cached prefix, at most max_tokens long (callers pass len - 1 so the last prompt token is
        always computed), among blocks cached under the same salt; `conversation`: the client's name for it,
        kept for the release. Changes nothing."""
        limit = min(len(token_ids), len(token_ids) if max_tokens is None else max_tokens)
        match = longest_match(self._root(salt), token_ids, limit if self.enabled else 0, self.block_size)
        match.salt, match.conversation = salt, conversation or None
        # Hybrid models: back to the last checkpoint (scheduler/checkpoints.py).
        return self.ckpt.trim(match, token_ids[len(match.shared) * self.block_size : limit], self._root(salt))

    def explain_miss(self, token_ids: list[int], match: PrefixMatch) -> dict | None:
        """Why a prompt reused no more than `match`, when the cache once held more of it: the position where
        it diverged from a cached sequence, or the eviction that took the rest. None for new content."""
        self.stats["hits" if match.num_tokens else "misses"] += 1
        miss = explain_miss(self._root(match.salt), token_ids, match, self.drops.dropped, self.block_size)
        if match.kv_tokens > match.num_tokens:  # the K/V was there, a state checkpoint was not
            miss = {"cause": "no_checkpoint", "position": match.num_tokens, "kv_tokens": match.kv_tokens}
        if match.state_window:  # a hit: the state is recomputed from a window (engine/state_window.py)
            self.stats["state_windows"] += 1
            return {"cause": "state_window", "position": match.num_tokens, "window": match.state_window,
                    "checkpoint": match.nearest_checkpoint}
        if miss is not None:
            self.stats["miss_" + miss["cause"]] += 1
        return miss

    @property
    def num_free(self) -> int:
        """Device blocks obtainable now: never-used plus unpinned cached ones (which can be moved off)."""
        return self._dev_free.num_free + self.index.num_unpinned_device

    @property
    def disk_free(self) -> int:
        """Disk-tier files that can still be written: the budget less disk-only blocks, resident copies and
        (hybrid models) the checkpoint files' slots."""
        return self.disk_blocks - len(self._on_disk) - len(self._disk_copies) - self.ckpt.units_on("disk")

    @property
    def num_cached(self) -> int:
        return len(self._on_device) + len(self._on_host) + len(self._on_disk)

    def usage(self) -> dict[str, int]:
        return {"device_cached": len(self._on_device), "device_in_use": self._num_owned
                + len(self._on_device) - self.index.num_unpinned_device, "device_total": self.num_blocks,
                "device_ceiling": max(self.num_blocks, self.admission.device_ceiling_blocks),
                "host_cached": len(self._on_host), "host_total": self.host_blocks,
                **self.admission.snapshot(len(self._on_host)),
                "disk_cached": len(self._on_disk), "disk_copies": len(self._disk_copies),
                "disk_unsaved": len(self.unsaved) if self.disk_blocks else 0, "disk_total": self.disk_blocks, **self.stats,
                "moves": getattr(self.mover, "totals", {}), **(self.ckpt.usage() if self.ckpt.enabled else {})}

    # -- plans (change nothing) ----------------------------------------------------------------------
    def plan_allocate(self, match: PrefixMatch, num_tokens: int, checkpoints: int = 0) -> Plan | None:
        """Pin the matched blocks (restoring parked ones) and fresh blocks up to num_tokens. None when the
        device cannot make room without moving pinned blocks (then nothing was decided). `checkpoints`:
        how many the request will take (hybrid models), each a device slot reserved from now on."""
        self.activity.expire()  # re-ranks conversations whose window passed; moves nothing
        match, payloads, unreadable = read_disk_blocks(self, match)
        if unreadable:  # shortened: back to a checkpoint (or a state window) in what is left
            match = self.ckpt.trim(match)
        match, state = self.ckpt.read_matched(match)
        fresh = blocks_needed(num_tokens, self.block_size) - len(match.shared)
        plan = Plan("allocate", fresh=fresh, match=match, payloads=payloads, unreadable=unreadable,
                    restores=[b for b in match.shared if not b.on_device], reserve_checkpoints=checkpoints,
                    checkpoint_state=state)
        plan.checkpoint_loads = {id(b): self.ckpt.read_disk(b) for b in plan.restores
                                 if not b.on_host and b.checkpoints}
        keep = set(match.shared) | ({match.cow_source} if match.cow_source else set())
        room = fresh + sum(self.ckpt.weight(b) for b in plan.restores) + checkpoints * self.ckpt.units
        if plan_device_room(self, plan, room, keep):
            return plan
        source = match.cow_source
        if source is None or not source.on_device:
            return None
        # The copy source occupies a block this request needs: take it over when nobody else can want it
        # (unpinned leaf), else give up its few tokens rather than wait forever.
        plan = Plan("allocate", fresh=fresh - 1, match=match, payloads=payloads, unreadable=unreadable,
                    restores=plan.restores, takeover=True, reserve_checkpoints=checkpoints,
                    checkpoint_state=state, checkpoint_loads=plan.checkpoint_loads)
        if source.ref_count == 0 and not source.children:
            room -= 1 + self.ckpt.units * len(source.checkpoints)  # its own checkpoints go with the takeover
            return plan if plan_device_room(self, plan, room, keep) else None
        return self.plan_allocate(self.ckpt.trim(PrefixMatch(match.shared, None, 0, match.salt, match.conversation)),
                                  num_tokens, checkpoints)

    def plan_extend(self, allocation: Allocation, num_tokens: int, checkpoints: int = 0) -> Plan | None:
        """Fresh blocks so a running request's table holds num_tokens (its next step), and a device slot
        for each checkpoint that step will take (hybrid models). None: no room."""
        self.activity.expire()
        plan = Plan("extend", fresh=max(0, blocks_needed(num_tokens, self.block_size) - len(allocation.block_table)),
                    allocation=allocation, reserve_checkpoints=checkpoints)
        room = plan.fresh + checkpoints * self.ckpt.units
        return plan if plan_device_room(self, plan, room, set()) else None

    def plan_shrink(self, num_blocks: int) -> Plan:
        """Bring the device pool down to num_blocks (or as near as it can without dropping anything)."""
        return plan_shrink(self, num_blocks)

    def plan_release(self, token_ids: list[int], num_computed: int, allocation: Allocation,
                     kind: str = "release", final_state=None) -> Plan:
        """A request is done (or preempted): its computed tokens' blocks join the tree, unpinned, with the
        checkpoints it took and (hybrid models) `final_state`, its state after num_computed tokens."""
        return Plan(kind, allocation=allocation, token_ids=list(token_ids), num_computed=num_computed,
                    final_state=final_state)

    # -- one call for callers without an admission of their own ----------------------------------------
    def allocate(self, match: PrefixMatch, total_tokens: int) -> Allocation | None:
        plan = self.plan_allocate(match, total_tokens)
        return self.apply(plan) if plan is not None and self.admission.grant(plan) else None

    def extend(self, allocation: Allocation, num_tokens: int) -> bool:
        plan = self.plan_extend(allocation, num_tokens)
        return plan is not None and self.admission.grant(plan) and self.apply(plan) is not None

    def release(self, token_ids: list[int], num_computed: int, allocation: Allocation) -> None:
        self.apply(self.plan_release(token_ids, num_computed, allocation))

    # -- apply (the only mutation) -------------------------------------------------------------------
    def apply(self, plan: Plan) -> Allocation:
        """Carry out a granted plan: drops, growth, spills, parks, then the request's own blocks."""
        self.drops.end_episodes({"device": self._dev_free.num_free / max(1, self.num_blocks),
                                 "host": self._host_free.num_free / max(1, self.host_blocks),
                                 "disk": 1 - len(self._on_disk) / max(1, self.disk_blocks)})
        moves = BlockMoves()
        if plan.kind == "shrink":
            if plan.host_grow:
                self._host_free.grow(plan.host_grow)
                moves.grow_host = self._host_free.num_blocks
            apply_shrink(self, plan, moves)
            self.mover.apply(moves)
            return None
        for node, k in plan.checkpoint_drops:  # room on the device: the states go, their pinned blocks stay
            self.ckpt.forget(node, k)
        if plan.kind in ("release", "preempt"):
            self._release(plan)
            return plan.allocation
        reuse = reuse_by_tier(plan) if plan.kind == "allocate" else {}
        sources = {}  # host slots of the blocks being restored, freed first: a park may take one over
        for block in plan.restores:
            if block.on_host:
                self.ckpt.move(block, "host", "device")
                sources[id(block)] = block.host_slot
                self._host_free.free([block.host_slot])
                del self._on_host[block.host_slot]
                block.host_slot = -1
                self.index.sync(block)
        for block in plan.unreadable:
            self._drop(block, "disk", "block file missing or corrupt")
        for block in plan.copy_drops:
            cache_disk.forget_disk_copy(self, block)
        for block in plan.disk_drops:
            self._drop(block, "disk", "disk tier full")
        if plan.host_grow:
            self._host_free.grow(plan.host_grow)
            moves.grow_host = self._host_free.num_blocks
        apply_growth(self, plan, moves)
        for block in plan.spills:
            cache_disk.spill(self, block, moves)
        for block in plan.host_drops:
            self._drop(block, "host", "host tier full" + ("" if self.disk_blocks else " (no disk tier)"))
        for block in plan.device_drops:
            self._drop(block, "device", "device pool full and no room in the host tier")
        for block in plan.parks:
            self._park(block, moves)
        alloc = self._apply_allocation(plan, moves, reuse, sources) if plan.kind == "allocate" \
            else self._apply_extend(plan)
        for block in self.mover.apply(moves):  # the disk writes that failed: those blocks are lost
            self.stats["spills"] -= 1
            self._drop(block, "host", "host tier full and the disk write failed")
        return alloc

    def _apply_allocation(self, plan: Plan, moves: BlockMoves, reuse: dict, sources: dict) -> Allocation:
        match, source = plan.match, plan.match.cow_source
        alloc = Allocation([], len(match.shared), match.num_tokens, reused_by_tier=reuse, salt=match.salt,
                           conversation=match.conversation, checkpoint_state=plan.checkpoint_state,
                           checkpoints_reserved=plan.reserve_checkpoints, state_window=match.state_window)
        self.ckpt.reserved += plan.reserve_checkpoints
        if plan.checkpoint_state is not None:
            self.ckpt.stats["restored"] += 1
        for block in match.shared:
            self._pin(block)
        for block in plan.restores:  # back to the device; the lower tier's copy is released
            device_id = self._dev_free.allocate(1)[0]
            if id(block) in sources:
                moves.restores.append((sources[id(block)], device_id))
            else:
                cache_disk.load(self, block, device_id, plan.payloads, moves, keep_source=False,
                           checkpoint_loads=plan.checkpoint_loads)
            block.device_id = device_id
            self._on_device[device_id] = block
        for block in match.shared:
            self.index.sync(block)
        if plan.takeover:  # the source becomes the request's own block: it leaves the tree and the disk
            self.ckpt.drop(source)  # the request writes into this block now; its states are for other tokens
            del source.parent.children[source.tokens]
            del self._on_device[source.device_id]
            self.unsaved.pop(id(source), None)
            if source.disk_copy:
                del self._disk_copies[source.digest]
                self.mover.delete_disk(source)
            self.activity.forget(source)
            self.index.sync(source)
            own = [source.device_id] + self._dev_free.allocate(plan.fresh)
        else:
            own = self._dev_free.allocate(plan.fresh)
            if source is not None:
                if source.on_device:
                    moves.copies.append((source.device_id, own[0]))
                else:
                    cache_disk.load(self, source, own[0], plan.payloads, moves, keep_source=True)
                source.last_used = next(self._clock)
                self.index.sync(source)
        self._num_owned += len(own)
        alloc.block_table = [b.device_id for b in match.shared] + own
        alloc.parks, alloc.restores, alloc.copies = moves.parks, moves.restores + [(-1, d) for d, _ in moves.writes], moves.copies
        self.stats["restores"] += len(alloc.restores)
        return alloc

    def _apply_extend(self, plan: Plan) -> Allocation:
        self.ckpt.reserved += plan.reserve_checkpoints
        plan.allocation.checkpoints_reserved += plan.reserve_checkpoints
        fresh = self._dev_free.allocate(plan.fresh)
        self._num_owned += plan.fresh
        plan.allocation.block_table.extend(fresh)
        return plan.allocation

    def _park(self, block: CachedBlock, moves: BlockMoves) -> None:
        slot = self._host_free.allocate(1)[0]
        self.ckpt.move(block, "device", "host")
        moves.parks.append((block.device_id, slot))
        del self._on_device[block.device_id]
        self._dev_free.free([block.device_id])
        block.device_id, block.host_slot = -1, slot
        self._on_host[slot] = block
        self.index.sync(block)
        self.stats["parks"] += 1

    def _release(self, plan: Plan) -> None:
        allocation, token_ids, num_computed = plan.allocation, plan.token_ids, plan.num_computed
        conversation = self.activity.for_release(allocation.conversation, token_ids, self.block_size,
                                                 finished=plan.kind == "release") if self.enabled else None
        node, path = self._root(allocation.salt), []
        for i, device_id in enumerate(allocation.block_table):
            start = i * self.block_size
            tokens = tuple(token_ids[start : min(start + self.block_size, num_computed)])
            if i < allocation.num_shared:
                node = self._on_device[device_id]
                self._unpin(node)
                self._keep(node, conversation)
                path.append(node)
                continue
            self._num_owned -= 1
            if not tokens or not self.enabled:
                self._dev_free.free([device_id])
                continue
            node = self._insert(node, tokens, device_id)
            self._keep(node, conversation)
            path.append(node)
        self.ckpt.attach_released(allocation, plan.final_state, num_computed, path if self.enabled else [],
                                  self.block_size)
        if conversation is not None:
            self.activity.forget_if_unused(conversation)  # a request that left nothing cached

    def _keep(self, block: CachedBlock, conversation) -> None:
        """A released block joins its request's conversation and the eviction order."""
        if conversation is not None:
            self.activity.own(block, conversation)
        self.index.sync(block)

    def _drop(self, block: CachedBlock, tier: str, reason: str) -> None:
        """Remove a block and everything cached after it; log what was lost."""
        if not (block.on_device or block.on_host or block.on_disk):
            return  # already gone with an ancestor dropped earlier in the same plan
        conv, lost = conversation_id(block), block.subtree()
        del block.parent.children[block.tokens]
        for node in lost:
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
            self.unsaved.pop(id(node), None)
            node.device_id, node.host_slot, node.on_disk, node.disk_copy = -1, -1, False, False
        for node in lost:  # parents first: each child then finds its parent already forgotten
            self.activity.forget(node)
            self.index.sync(node)
        tokens = sum(len(n.tokens) for n in lost)
        total = {"device": self.num_blocks, "host": self.host_blocks, "disk": self.disk_blocks}[tier]
        self.drops.record([n.digest for n in lost], tier, reason, conv, tokens, total)
        self.stats["dropped_blocks"] += len(lost)
        self.stats["dropped_tokens"] += tokens

    def check_integrity(self) -> None:
        """Per tier: free + cached (+ owned) == total; tree links consistent; pinned blocks on device."""
        check_cache(self)

    # -- tree ----------------------------------------------------------------------------------------
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
            checkpoint_adopt.adopt_parked_states(self, existing)  # its states come along where the device has room
            if existing.on_host:
                self._host_free.free([existing.host_slot])
                del self._on_host[existing.host_slot]
                existing.host_slot = -1
            if existing.on_disk:  # its file holds these very bytes: it stays, as the fresh copy's file
                del self._on_disk[existing.digest]
                existing.on_disk, existing.disk_copy = False, True
                self._disk_copies[existing.digest] = existing
            block = existing
        else:
            block = CachedBlock(tokens, parent, digest=block_digest(parent.digest, tokens))
            parent.children[tokens] = block
        block.device_id, block.last_used = device_id, next(self._clock)
        self._on_device[device_id] = block
        if self.disk_blocks and not block.disk_copy:
            self.unsaved[id(block)] = block
        return block

    def _pin(self, block: CachedBlock) -> None:
        block.ref_count += 1
        block.last_used = next(self._clock)

    def _unpin(self, block: CachedBlock) -> None:
        assert block.ref_count > 0, "block unpinned more often than pinned"
        block.ref_count -= 1
        block.last_used = next(self._clock)
