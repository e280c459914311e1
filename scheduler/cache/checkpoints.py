"""State checkpoints in the conversation cache, for models with recurrent layers (lfm2's short convs).

A recurrent layer's state at position p cannot be cut out of a longer one, so a cached K/V prefix is only
usable up to a position where the cache also holds the state: a checkpoint. A tree node carries the
checkpoints taken after some of its tokens (`CachedBlock.checkpoints`: k = tokens of the node before the
state; k == len(tokens) is "after its last token"). Where the engine takes them, per request:

    prompt:  |-- N blocks --|-- N blocks --|-- ... --|x|       x = prompt_len - 1: the same prompt again
             ^ every N blocks (--state-checkpoint-every)  ^         reuses all but its last token
               (each moved to the nearest line start within N/2 blocks, api/checkpoint_hints.py)
             + the API's hints: where each message and its content begin (and 8, 16 tokens into it),
               where a blank line begins
               (api/branch_hints.py)
             + where the prompt left the cached sequence it matched (the next variant branches there too)
    release: the end of what the request computed (its reply, or where it was preempted)

Under pressure checkpoints give way before K/V: a request without room for one goes on without it, one
short of room gives up those it holds one by one, and a plan may drop those on pinned blocks.

A match is the longest cached prefix whose end has a checkpoint (`trim`); K/V blocks beyond it stay in the
tree. A checkpoint lives in the tier of its node and moves with it (parked, restored, spilled, dropped by
the same plans and in the same value order); it costs `units` block slots of that tier, so the tiers'
budgets count its bytes. With a disk tier a resident checkpoint gets a file while serving, after its
block's (scheduler/cache/write_behind.py; until then its node is in `unsaved`): a copy that costs `units` disk
slots, spills for free and goes with its block's copy. Running requests reserve a slot for each checkpoint
they take before the step that takes it (`Allocation.checkpoints_reserved`), so a release needs no room.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from scheduler.cache.checkpoint_match import trim as trim_to_checkpoint
from scheduler.cache.checkpoint_spacing import most_useful, snap_to_line
from scheduler.cache.tree import CachedBlock, PrefixMatch
from scheduler.cache.checkpoint_store import CheckpointStore

if TYPE_CHECKING:
    from scheduler.cache.plans import Allocation


class Checkpoints:
    """The cache's checkpoint bookkeeping: which nodes carry states, what they cost, the bytes' store.

    `units` == 0 (a model without recurrent layers) disables everything: every hook is then a no-op."""

    def __init__(self, units: int = 0, every_blocks: int = 0, store: CheckpointStore | None = None,
                 window_tokens: int = 0):
        self.units = units  # block slots one checkpoint takes in its tier
        self.every_blocks = every_blocks  # 0: none but the hints, the prompt's end and release
        # > 0 (lfm2): the state at any cached position can be recomputed from this many tokens
        # before it (engine/state_window.py), so a match ends where the K/V does when that is cheaper
        self.window_tokens = window_tokens
        self.store = store or CheckpointStore()
        self.nodes: dict[int, CachedBlock] = {}  # id -> node that carries checkpoints
        self.reserved = 0  # checkpoints running requests will take (device slots held for them)
        self.unsaved: dict[int, CachedBlock] = {}  # id -> resident node with a checkpoint that has no file
        self.stats = {"taken": 0, "attached": 0, "restored": 0, "dropped": 0}
        # Called with a node whose checkpoints came or went (the cache's eviction index re-weighs it).
        self.on_change: Callable[[CachedBlock], None] = lambda node: None

    @property
    def enabled(self) -> bool:
        return self.units > 0

    def count(self, tier: str) -> int:
        """Checkpoints in `tier`, read off the store in O(1) (the integrity check holds it equal to the tree)."""
        return self.store.count(tier)

    def units_on(self, tier: str) -> int:
        """Block slots of `tier` the checkpoints take (device: including those reserved by requests; disk:
        including the files of resident ones)."""
        extra = self.reserved if tier == "device" else len(self.store.copies) if tier == "disk" else 0
        return self.units * (self.count(tier) + extra)

    def copies_on(self, node: CachedBlock) -> int:
        """Checkpoints of a resident node that have a file on disk too."""
        return sum((node.digest, k) in self.store.copies for k in node.checkpoints)

    def unsaved_of(self, node: CachedBlock) -> list[int]:
        """The node's checkpoints without a file (ascending k)."""
        return sorted(k for k in node.checkpoints if (node.digest, k) not in self.store.copies)

    def weight(self, node: CachedBlock) -> int:
        """Slots a node frees when it leaves its tier: its block and its checkpoints."""
        return 1 + self.units * len(node.checkpoints)

    def gap(self, node: CachedBlock, k: int) -> int:
        """Tokens from the checkpoint before this one on its path (or the start) to this one: what a prompt
        that branches here recomputes if this one is gone. The cheapest to lose goes first under pressure."""
        tokens, before = k, [j for j in node.checkpoints if j < k]
        while not before and node.parent is not None and node.parent.parent is not None:
            node = node.parent
            tokens += len(node.tokens)
            before = list(node.checkpoints)
        return tokens - max(before) if before else tokens

    def positions(self, prompt_len: int, block_size: int, hints: tuple[int, ...] = (),
                  line_starts: tuple[int, ...] = ()) -> list[int]:
        """Where a request takes checkpoints while it computes its prompt (ascending): every N blocks, at
        the hints (where its messages begin, api/checkpoint_hints.py) and at prompt_len - 1. A periodic one
        moves to the nearest line start within half a period (`line_starts`, ascending), where a later
        prompt more likely branches; their count stays the same (the byte rule's density)."""
        if not self.enabled or prompt_len < 2:
            return []
        step = self.every_blocks * block_size
        out = {snap_to_line(p, step, line_starts, prompt_len - 1) for p in range(step, prompt_len - 1, step)} if step else set()
        out.update(p for p in hints if 0 < p < prompt_len - 1)
        return sorted(out) + [prompt_len - 1]

    # -- matching (scheduler/cache/checkpoint_match.py) ----------------------------------------------------
    def trim(self, match: PrefixMatch, rest: list[int] | None = None, root: CachedBlock | None = None) -> PrefixMatch:
        """The longest prefix of `match` whose end carries a checkpoint, or (lfm2) the K/V match with a
        state window; see checkpoint_match.trim."""
        return trim_to_checkpoint(match, self.window_tokens, rest, root) if self.enabled else match

    def shorter(self, match: PrefixMatch) -> PrefixMatch:
        """A strictly shorter match, for a request the device cannot take with `match` while nothing else
        runs (the parked blocks it restores bring their checkpoints along, `units` slots each): without its
        copied head, else without its last block, back to the last checkpoint in what is left (or a window)."""
        kept = match.shared if match.cow_source is not None else match.shared[:-1]
        out = self.trim(PrefixMatch(list(kept), None, 0, match.salt, match.conversation))
        out.kv_tokens = match.kv_tokens
        return out

    # -- bytes follow their node ---------------------------------------------------------------------
    def read(self, node: CachedBlock, k: int) -> np.ndarray | None:
        return self.store.get(node.tier, (node.digest, k))

    def attach(self, node: CachedBlock, k: int, state: np.ndarray) -> bool:
        """A checkpoint on a device node (from a releasing request's reservation); False if it has one."""
        assert node.on_device and 0 < k <= len(node.tokens), f"checkpoint at {k} of a {node.tier} node"
        if k in node.checkpoints:
            return False
        self.store.put("device", (node.digest, k), state)
        node.checkpoints.add(k)
        self.nodes[id(node)] = node
        self.stats["attached"] += 1
        self._track(node)
        self.on_change(node)
        return True

    def _track(self, node: CachedBlock) -> None:
        """Keep `unsaved` in step with a node whose checkpoints or files changed (only with a disk tier)."""
        if self.store.dir is not None and not node.on_disk and self.unsaved_of(node):
            self.unsaved[id(node)] = node
        else:
            self.unsaved.pop(id(node), None)

    def save(self, node: CachedBlock, k: int) -> bool:
        """Write the file of a resident checkpoint, whose block's file is written (write-behind)."""
        assert node.disk_copy and k in node.checkpoints, "a checkpoint file before its block's"
        ok = self.store.write_copy((node.digest, k), node.tier)
        self._track(node)
        return ok

    def forget_copies(self, node: CachedBlock) -> None:
        """The node's block file is deleted for room: its checkpoints' files go too (they stay resident)."""
        for k in node.checkpoints:
            self.store.drop_copy((node.digest, k))
        self._track(node)

    def move(self, node: CachedBlock, src: str, dst: str) -> None:
        for k in node.checkpoints:
            self.store.move((node.digest, k), src, dst)

    def spill(self, node: CachedBlock, src: str) -> None:
        lost = 0
        for k in sorted(node.checkpoints):
            if not self.store.spill((node.digest, k), src):
                node.checkpoints.discard(k)  # the write failed: the state is lost, the block is not
                lost += 1
        self.stats["dropped"] += lost
        if not node.checkpoints:
            self.nodes.pop(id(node), None)
        self.unsaved.pop(id(node), None)
        if lost:
            self.on_change(node)

    def read_disk(self, node: CachedBlock) -> dict[int, np.ndarray]:
        """The states of a disk node that is about to be restored (unreadable ones are left out)."""
        out = {}
        for k in node.checkpoints:
            state = self.store.read_file((node.digest, k))
            if state is not None:
                out[k] = state
        return out

    def load(self, node: CachedBlock, states: dict[int, np.ndarray]) -> None:
        """A disk node restored to the device: its readable states come along and their files stay as
        copies (as its block's does); the unreadable ones' go."""
        lost = False
        for k in list(node.checkpoints):
            if k in states:
                self.store.keep_as_copy((node.digest, k), states[k])
            else:
                self.store.delete("disk", (node.digest, k))
                node.checkpoints.discard(k)
                self.stats["dropped"] += 1
                lost = True
        if not node.checkpoints:
            self.nodes.pop(id(node), None)
        if lost:
            self.on_change(node)

    def forget(self, node: CachedBlock, k: int) -> None:
        """Drop one checkpoint of a node (its block stays)."""
        if k in node.checkpoints:
            self.store.delete(node.tier, (node.digest, k))
            node.checkpoints.discard(k)
            self.stats["dropped"] += 1
            self.on_change(node)
        if not node.checkpoints:
            self.nodes.pop(id(node), None)
        self._track(node)

    def give_up_pending(self, allocation: "Allocation") -> None:
        """A running request short of room gives back one checkpoint slot (the caller asks again while it
        is short): a reservation not used yet, else the least useful state it took (`most_useful`: branch
        points, where a message begins or the prompt left a cached sequence, last), else the one kept for
        its release."""
        assert allocation.checkpoints_reserved > 0, "no checkpoint slot to give up"
        pending = allocation.pending_checkpoints
        if allocation.checkpoints_reserved - 1 <= len(pending) and pending:
            position = most_useful(pending, allocation.cached_tokens, allocation.branch_points)[-1]
            del pending[position]
            allocation.branch_points.discard(position)
            self.stats["dropped"] += 1
        allocation.checkpoints_reserved -= 1
        self.reserved -= 1

    def drop(self, node: CachedBlock) -> None:
        """Forget a node's checkpoints (the node is dropped, taken over, or replaced); call while its
        tier is still set."""
        for k in node.checkpoints:
            self.store.delete(node.tier, (node.digest, k))
        had = bool(node.checkpoints)
        self.stats["dropped"] += len(node.checkpoints)
        node.checkpoints.clear()
        self.nodes.pop(id(node), None)
        self.unsaved.pop(id(node), None)
        if had:
            self.on_change(node)

    def read_matched(self, match: PrefixMatch) -> tuple[PrefixMatch, np.ndarray | None]:
        """The state the match ends at, read when the allocation is planned. A checkpoint file that is gone
        or corrupt is forgotten (its block stays) and the match goes back to an earlier checkpoint."""
        while match.checkpoint is not None:
            state = self.read(*match.checkpoint)
            if state is not None:
                return match, state
            self.forget(*match.checkpoint)
            match = self.trim(PrefixMatch(match.shared, match.cow_source, match.cow_tokens, match.salt,
                                          match.conversation))
        return match, None

    # -- running requests ----------------------------------------------------------------------------
    def take(self, allocation: "Allocation", position: int, state: np.ndarray, branch_point: bool = False) -> None:
        """A request's state after `position` computed tokens, held until its release attaches it;
        `branch_point`: where prompts branch (a message start, the prompt's end, where it left a match)."""
        assert len(allocation.pending_checkpoints) + 1 < allocation.checkpoints_reserved, "checkpoint not reserved"
        allocation.pending_checkpoints[position] = state
        if branch_point:
            allocation.branch_points.add(position)
        self.stats["taken"] += 1

    def attach_released(self, allocation: "Allocation", final_state, num_computed: int, path: list[CachedBlock],
                        block_size: int) -> None:
        """A released request's checkpoints (those it took, and `final_state` after num_computed tokens)
        join the nodes of `path` (its blocks in the tree, in order) they end in; its reservations are given
        back. An empty path (the cache is off) attaches nothing. Only as many as it reserved slots for
        (a request admitted without room for them has none): the final state first, then `most_useful`."""
        states = dict(allocation.pending_checkpoints)
        kept = most_useful(states, allocation.cached_tokens, allocation.branch_points)
        if final_state is not None and num_computed > 0:
            states[num_computed] = final_state
            kept = [num_computed] + [p for p in kept if p != num_computed]
        kept = kept[: allocation.checkpoints_reserved]
        states = {p: states[p] for p in kept}
        self.reserved -= allocation.checkpoints_reserved
        allocation.checkpoints_reserved, allocation.pending_checkpoints = 0, {}
        for position, state in sorted(states.items()):
            index = (position - 1) // block_size
            if 0 < position <= num_computed and index < len(path):
                self.attach(path[index], position - index * block_size, state)

    def usage(self) -> dict:
        store = self.store
        return {"checkpoints_" + t: self.count(t) for t in ("device", "host", "disk")} | {
            "checkpoint_bytes_" + t: store.nbytes(t) for t in ("device", "host", "disk")} | {
            "checkpoints_reserved": self.reserved, "checkpoints_disk_copies": len(store.copies),
            "checkpoints_unsaved": sum(map(len, map(self.unsaved_of, self.unsaved.values()))),
            "checkpoint_state_bytes": store.state_bytes,
            "checkpoint_units": self.units, **{"checkpoints_" + k: v for k, v in self.stats.items()}}

