"""The conversation cache: token-exact longest-prefix reuse over a tree of KV blocks, in three tiers.

Full blocks are shared in place; a prompt that diverges or ends inside a block reuses that block's
matching tokens by copy-on-write into a block the request owns, so a shared block is never written.
Many variants of a conversation coexist as branches (a toggling tool list hits both).

    root ── [sys prompt 0:16] ── [16:32] ── [32:48 turn 1] ── [48:57 reply tail, partial]
                                        └── [32:48 other conversation] ...

`PrefixCache` is the front door (match / plan / apply / release / check_integrity) over its parts, each
with one job: the tree (scheduler/cache/tree.py: match, insert; pure), the tiers (tiers.py: residency and
the allocators of the device pool, host RAM and disk), the eviction order (eviction_index.py), the
checkpoints of hybrid models (checkpoints.py), the planner (planner.py: reads a `CacheView`, returns a
typed plan per kind, plans.py) and the applier (apply.py: carries out a granted plan).
Decide, grant, apply: `plan_allocate` / `plan_extend` / `plan_shrink` / `plan_release` return a plan and
change nothing; the memory admission grants it whole or refuses it; `apply` then changes the tree and the
tiers and hands the byte moves to the mover in one call (parks, restores, loads, copies; spills first).
`allocate` / `extend` / `release` do the three steps for callers that have no admission of their own.
Blocks pinned by running requests never move; every drop is logged with its conversation.
"""
from __future__ import annotations

from typing import Mapping

from scheduler.cache.apply import Applier
from scheduler.cache.block_mover import BlockMover, RecordingMover
from scheduler.cache.checkpoints import Checkpoints
from scheduler.cache.conversation_activity import ACTIVE_WINDOW_S, ConversationActivity
from scheduler.cache.drops import DropLog
from scheduler.cache.eviction_index import EvictionIndex
from scheduler.cache.explain import explain_miss
from scheduler.cache.integrity import check_cache
from scheduler.cache.planner import Planner
from scheduler.cache.plans import AllocatePlan, Allocation, ExtendPlan, Plan, ReleasePlan, ShrinkPlan
from scheduler.cache.tiers import Tiers
from scheduler.cache.tree import CachedBlock, PrefixMatch, Tree
from scheduler.cache.view import CacheView
from scheduler.memory.admission import MemoryAdmission

__all__ = ["Allocation", "PrefixCache"]


class PrefixCache:
    """Owns every device block id and host slot (through its tiers): free, cached (unpinned) or in use
    (pinned / owned by running requests)."""

    def __init__(self, num_blocks: int, block_size: int, enabled: bool = True, host_blocks: int = 0,
                 disk_blocks: int = 0, mover: BlockMover | None = None, block_bytes: int = 0,
                 admission: MemoryAdmission | None = None, active_window_s: float = ACTIVE_WINDOW_S,
                 checkpoints: Checkpoints | None = None):
        self.enabled = enabled  # off: nothing is ever matched or kept (the reference for tests)
        self.block_size = block_size
        self.admission = admission or MemoryAdmission(host_blocks, block_bytes)
        assert self.admission.host_budget_blocks == host_blocks, "the cache and its admission disagree on the host budget"
        self.mover = mover or RecordingMover()
        self.drops = DropLog(block_bytes)
        self.tree = Tree()
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
        self.tiers = Tiers(num_blocks, host_blocks, self.admission.host_committed_blocks, disk_blocks, self.ckpt,
                           self.index, self.mover, self.stats)
        self.view = CacheView(self.tiers, self.index, self.ckpt, self.admission, self.mover, block_size)
        self.planner = Planner(self.view)
        self._applier = Applier(self.view, self.tree, self.activity, self.drops, self.stats, enabled)

    # -- queries -------------------------------------------------------------------------------------
    def match(self, token_ids: list[int], max_tokens: int | None = None, salt: str = "",
              conversation: str | None = None) -> PrefixMatch:
        """Longest cached prefix, at most max_tokens long (callers pass len - 1 so the last prompt token is
        always computed), among blocks cached under the same salt; `conversation`: the client's name for it,
        kept for the release. Changes nothing."""
        limit = min(len(token_ids), len(token_ids) if max_tokens is None else max_tokens)
        match = self.tree.match(salt, token_ids, limit if self.enabled else 0, self.block_size)
        match.salt, match.conversation = salt, conversation or None
        # Hybrid models: back to the last checkpoint (scheduler/cache/checkpoints.py).
        return self.ckpt.trim(match, token_ids[len(match.shared) * self.block_size : limit], self.tree.root(salt))

    def explain_miss(self, token_ids: list[int], match: PrefixMatch) -> dict | None:
        """Why a prompt reused no more than `match`, when the cache once held more of it: the position where
        it diverged from a cached sequence, or the eviction that took the rest. None for new content.
        Counts the hit or miss."""
        self.stats["hits" if match.num_tokens else "misses"] += 1
        miss = explain_miss(self.tree.root(match.salt), token_ids, match, self.drops.dropped, self.block_size)
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
    def num_blocks(self) -> int:
        """The device pool's size now (the elastic pool grows and shrinks it)."""
        return self.tiers.num_blocks

    @property
    def host_blocks(self) -> int:
        """The host tier's budget; the admission's host_committed_blocks of it are usable now."""
        return self.tiers.host_blocks

    @property
    def disk_blocks(self) -> int:
        return self.tiers.disk_blocks

    @property
    def unsaved(self) -> Mapping[int, CachedBlock]:
        """Resident blocks with no file yet (the write-behind's queue), by id."""
        return self.tiers.unsaved

    @property
    def num_free(self) -> int:
        """Device blocks obtainable now: never-used plus unpinned cached ones (which can be moved off)."""
        return self.tiers.num_free_ids("device") + self.index.num_unpinned_device

    @property
    def disk_free(self) -> int:
        """Disk-tier files that can still be written: the budget less disk-only blocks, resident copies and
        (hybrid models) the checkpoint files' slots."""
        return self.tiers.free_slots("disk")

    @property
    def num_cached(self) -> int:
        return self.tiers.num_cached

    def usage(self) -> dict[str, int]:
        """Counts per tier, the admission's budgets and the cache's counters (metrics, /cache)."""
        tiers = self.tiers
        on_device, on_host = len(tiers.blocks("device")), len(tiers.blocks("host"))
        return {"device_cached": on_device, "device_in_use": tiers.num_owned
                + on_device - self.index.num_unpinned_device, "device_total": tiers.num_blocks,
                "device_ceiling": max(tiers.num_blocks, self.admission.device_ceiling_blocks),
                "host_cached": on_host, "host_total": tiers.host_blocks,
                **self.admission.snapshot(on_host),
                "disk_cached": len(tiers.blocks("disk")), "disk_copies": len(tiers.blocks("copies")),
                "disk_unsaved": len(tiers.unsaved) if tiers.disk_blocks else 0, "disk_total": tiers.disk_blocks,
                **self.stats, "moves": getattr(self.mover, "totals", {}),
                **(self.ckpt.usage() if self.ckpt.enabled else {})}

    # -- plans (change nothing) ----------------------------------------------------------------------
    def plan_allocate(self, match: PrefixMatch, num_tokens: int, checkpoints: int = 0) -> AllocatePlan | None:
        """Pin the matched blocks (restoring parked ones) and fresh blocks up to num_tokens. None when the
        device cannot make room without moving pinned blocks (then nothing was decided). `checkpoints`:
        how many the request will take (hybrid models), each a device slot reserved from now on."""
        self.activity.expire()  # re-ranks conversations whose window passed; moves nothing
        return self.planner.allocate(match, num_tokens, checkpoints)

    def plan_extend(self, allocation: Allocation, num_tokens: int, checkpoints: int = 0) -> ExtendPlan | None:
        """Fresh blocks so a running request's table holds num_tokens (its next step), and a device slot
        for each checkpoint that step will take (hybrid models). None: no room."""
        self.activity.expire()
        return self.planner.extend(allocation, num_tokens, checkpoints)

    def plan_shrink(self, num_blocks: int) -> ShrinkPlan:
        """Bring the device pool down to num_blocks (or as near as it can without dropping anything)."""
        return self.planner.shrink(num_blocks)

    def plan_release(self, token_ids: list[int], num_computed: int, allocation: Allocation,
                     kind: str = "release", final_state=None) -> ReleasePlan:
        """A request is done (kind "release") or preempted ("preempt"): its computed tokens' blocks join the
        tree, unpinned, with the checkpoints it took and (hybrid models) `final_state`, its state after
        num_computed tokens."""
        assert kind in ("release", "preempt"), kind
        return self.planner.release(token_ids, num_computed, allocation, kind == "preempt", final_state)

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
    def apply(self, plan: Plan) -> Allocation | None:
        """Carry out a granted plan (scheduler/cache/apply.py): drops, growth, spills, parks, then the
        request's own blocks. Returns the request's allocation; None for a shrink."""
        return self._applier.apply(plan)

    def check_integrity(self) -> None:
        """Per tier: free + cached (+ owned) == total; tree links consistent; pinned blocks on device; the
        eviction index, the conversations and the checkpoints against a full scan."""
        check_cache(self.tiers, self.index, self.activity, self.ckpt, self.admission.host_committed_blocks,
                    self.block_size)
