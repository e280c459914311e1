"""Applying a granted plan: the only place the conversation cache's tree and tiers change for a request.

`PrefixCache.apply` hands each granted plan here; the applier dispatches on its type and carries it out in
one order that keeps every byte move safe: drops, growth, spills, parks, then the request's own blocks,
and hands the byte moves to the mover in one call (scheduler/cache/block_mover.py). Residency changes go
through `Tiers`; every change to a cached block is followed by `index.sync(block)`.
"""
from __future__ import annotations

import itertools
import logging

from scheduler.cache.block_mover import BlockMoves
from scheduler.cache.checkpoint_adopt import adopt_parked_states
from scheduler.cache.conversation_activity import ConversationActivity
from scheduler.cache.drops import DropLog
from scheduler.cache.plans import AllocatePlan, Allocation, ExtendPlan, Plan, ReleasePlan, RoomPlan, ShrinkPlan
from scheduler.cache.tree import CachedBlock, Tree, conversation_id
from scheduler.cache.view import CacheView

log = logging.getLogger("strata.cache")


class Applier:
    """Carries out granted plans on the tree and the tiers. `stats`: the cache's counters."""

    def __init__(self, view: CacheView, tree: Tree, activity: ConversationActivity, drops: DropLog,
                 stats: dict[str, int], enabled: bool):
        self.view, self.tree, self.activity, self.drops, self.stats = view, tree, activity, drops, stats
        self.tiers, self.index, self.ckpt = view.tiers, view.index, view.ckpt
        self.enabled = enabled
        self._clock = itertools.count(1)  # last use, unique per touch: the eviction order's tie-breaker

    def apply(self, plan: Plan) -> Allocation | None:
        """Carry out a granted plan. Returns the request's allocation (None for a shrink)."""
        self.drops.end_episodes(self.tiers.free_fractions())
        if isinstance(plan, ReleasePlan):
            self._release(plan)
            return plan.allocation
        moves = BlockMoves()
        if isinstance(plan, ShrinkPlan):
            self._grow_host(plan, moves)
            self._shrink(plan, moves)
            self.view.mover.apply(moves)
            return None
        assert isinstance(plan, (AllocatePlan, ExtendPlan)), f"no way to apply a {type(plan).__name__}"
        for node, k in plan.checkpoint_drops:  # room on the device: the states go, their pinned blocks stay
            self.ckpt.forget(node, k)
        allocate = isinstance(plan, AllocatePlan)
        reuse = plan.reuse_by_tier() if allocate else {}
        sources = {}  # host slots of the blocks being restored, freed first: a park may take one over
        for block in plan.restores if allocate else ():
            if block.on_host:
                sources[id(block)] = self.tiers.leave_host(block)
                self.index.sync(block)
        for block in plan.unreadable if allocate else ():
            self._drop(block, "disk", "block file missing or corrupt")
        self._make_room(plan, moves)
        alloc = self._allocate(plan, moves, reuse, sources) if allocate else self._extend(plan)
        for block in self.view.mover.apply(moves):  # the disk writes that failed: those blocks are lost
            self.stats["spills"] -= 1
            self._drop(block, "host", "host tier full and the disk write failed")
        return alloc

    def _make_room(self, plan: RoomPlan, moves: BlockMoves) -> None:
        tiers = self.tiers
        for block in plan.copy_drops:
            tiers.forget_disk_copy(block)
        for block in plan.disk_drops:
            self._drop(block, "disk", "disk tier full")
        self._grow_host(plan, moves)
        self._grow_device(plan, moves)
        for block in plan.spills:
            tiers.spill(block, moves)
        for block in plan.host_drops:
            self._drop(block, "host", "host tier full" + ("" if tiers.disk_blocks else " (no disk tier)"))
        for block in plan.device_drops:
            self._drop(block, "device", "device pool full and no room in the host tier")
        for block in plan.parks:
            tiers.park(block, moves)

    def _allocate(self, plan: AllocatePlan, moves: BlockMoves, reuse: dict, sources: dict) -> Allocation:
        match, source, tiers = plan.match, plan.match.cow_source, self.tiers
        alloc = Allocation([], len(match.shared), match.num_tokens, reused_by_tier=reuse, salt=match.salt,
                           conversation=match.conversation, checkpoint_state=plan.checkpoint_state,
                           checkpoints_reserved=plan.reserve_checkpoints, state_window=match.state_window)
        self.ckpt.reserved += plan.reserve_checkpoints
        if plan.checkpoint_state is not None:
            self.ckpt.stats["restored"] += 1
        for block in match.shared:
            self._pin(block)
        for block in plan.restores:  # back to the device; the lower tier's copy is released
            device_id = tiers.restore_target()
            if id(block) in sources:
                moves.restores.append((sources[id(block)], device_id))
            else:
                tiers.load(block, device_id, plan.payloads, moves, keep_source=False,
                           checkpoint_loads=plan.checkpoint_loads)
            tiers.place(block, device_id)
        for block in match.shared:
            self.index.sync(block)
        if plan.takeover:  # the source becomes the request's own block: it leaves the tree and the disk
            self.ckpt.drop(source)  # the request writes into this block now; its states are for other tokens
            self.tree.detach(source)
            own = [tiers.take_over(source)]
            self.activity.forget(source)
            self.index.sync(source)
            own += tiers.allocate_owned(plan.fresh)
        else:
            own = tiers.allocate_owned(plan.fresh)
            if source is not None:
                if source.on_device:
                    moves.copies.append((source.device_id, own[0]))
                else:
                    tiers.load(source, own[0], plan.payloads, moves, keep_source=True)
                source.last_used = next(self._clock)
                self.index.sync(source)
        alloc.block_table = [b.device_id for b in match.shared] + own
        alloc.parks, alloc.restores, alloc.copies = moves.parks, moves.restores + [(-1, d) for d, _ in moves.writes], moves.copies
        self.stats["restores"] += len(alloc.restores)
        return alloc

    def _extend(self, plan: ExtendPlan) -> Allocation:
        self.ckpt.reserved += plan.reserve_checkpoints
        plan.allocation.checkpoints_reserved += plan.reserve_checkpoints
        plan.allocation.block_table.extend(self.tiers.allocate_owned(plan.fresh))
        return plan.allocation

    def _grow_host(self, plan: RoomPlan, moves: BlockMoves) -> None:
        if plan.host_grow:
            moves.grow_host = self.tiers.grow_host(plan.host_grow)

    def _grow_device(self, plan: RoomPlan, moves: BlockMoves) -> None:
        """New ids at the top of the pool, free, before the plan's other moves need them."""
        if plan.device_grow:
            size = moves.grow_device = self.tiers.grow_device(plan.device_grow)
            self.stats["device_grows"] += 1
            log.info("device KV pool grown to %d blocks (ceiling %d)", size, self.view.admission.device_ceiling_blocks,
                     extra={"fields": {"device_blocks": size}})

    def _shrink(self, plan: ShrinkPlan, moves: BlockMoves) -> None:
        """Relocate and park what the plan vacates, then give the ids above plan.shrink_to back."""
        for block, new_id in plan.relocations:
            self.tiers.relocate(block, new_id, moves)
        for block in plan.parks:
            self.tiers.park(block, moves)
        old = self.tiers.shrink_device(plan.shrink_to)
        moves.shrink_device = plan.shrink_to
        self.stats["device_shrinks"] += 1
        fields = {"device_blocks": plan.shrink_to, "relocated": len(plan.relocations), "parked": len(plan.parks)}
        log.info("device KV pool shrunk from %d to %d blocks: %d cached blocks moved down, %d parked to host RAM, "
                 "none dropped", old, plan.shrink_to, len(plan.relocations), len(plan.parks), extra={"fields": fields})
        if plan.stopped_by:
            log.warning("device KV pool shrink stopped at %d blocks: %s", plan.shrink_to, plan.stopped_by,
                        extra={"fields": {**fields, "reason": plan.stopped_by}})

    def _release(self, plan: ReleasePlan) -> None:
        allocation, token_ids, num_computed = plan.allocation, plan.token_ids, plan.num_computed
        block_size = self.view.block_size
        conversation = self.activity.for_release(allocation.conversation, token_ids, block_size,
                                                 finished=not plan.preempt) if self.enabled else None
        node, path = self.tree.root(allocation.salt), []
        for i, device_id in enumerate(allocation.block_table):
            start = i * block_size
            tokens = tuple(token_ids[start : min(start + block_size, num_computed)])
            if i < allocation.num_shared:
                node = self.tiers.blocks("device")[device_id]
                self._unpin(node)
                self._keep(node, conversation)
                path.append(node)
                continue
            cached = bool(tokens) and self.enabled
            self.tiers.disown(device_id, cached)
            if not cached:
                continue
            node = self._insert(node, tokens, device_id)
            self._keep(node, conversation)
            path.append(node)
        self.ckpt.attach_released(allocation, plan.final_state, num_computed, path if self.enabled else [], block_size)
        if conversation is not None:
            self.activity.forget_if_unused(conversation)  # a request that left nothing cached

    def _keep(self, block: CachedBlock, conversation) -> None:
        """A released block joins its request's conversation and the eviction order."""
        if conversation is not None:
            self.activity.own(block, conversation)
        self.index.sync(block)

    def _insert(self, parent: CachedBlock, tokens: tuple[int, ...], device_id: int) -> CachedBlock:
        existing = parent.children.get(tokens)
        if existing is not None and existing.on_device:  # same content already cached: keep one copy
            self.tiers.free_device(device_id)
            existing.last_used = next(self._clock)
            return existing
        if existing is not None:  # parked copy of the same content: the fresh device copy replaces it
            # its states come along where the device has room
            adopt_parked_states(self.ckpt, existing, self.tiers.free_slots("device"))
            self.tiers.replace_parked(existing)
            block = existing
        else:
            block = self.tree.insert(parent, tokens)
        block.last_used = next(self._clock)
        self.tiers.place(block, device_id)
        self.tiers.queue_unsaved(block)
        return block

    def _drop(self, block: CachedBlock, tier: str, reason: str) -> None:
        """Remove a block and everything cached after it; log what was lost."""
        if not (block.on_device or block.on_host or block.on_disk):
            return  # already gone with an ancestor dropped earlier in the same plan
        conv, lost = conversation_id(block), block.subtree()
        self.tree.detach(block)
        for node in lost:
            self.tiers.drop(node)
        for node in lost:  # parents first: each child then finds its parent already forgotten
            self.activity.forget(node)
            self.index.sync(node)
        tokens = sum(len(n.tokens) for n in lost)
        tiers = self.tiers
        total = {"device": tiers.num_blocks, "host": tiers.host_blocks, "disk": tiers.disk_blocks}[tier]
        self.drops.record([n.digest for n in lost], tier, reason, conv, tokens, total)
        self.stats["dropped_blocks"] += len(lost)
        self.stats["dropped_tokens"] += tokens

    def _pin(self, block: CachedBlock) -> None:
        block.ref_count += 1
        block.last_used = next(self._clock)

    def _unpin(self, block: CachedBlock) -> None:
        assert block.ref_count > 0, "block unpinned more often than pinned"
        block.ref_count -= 1
        block.last_used = next(self._clock)
