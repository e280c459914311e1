"""The engine loop's part in a hybrid model's recurrent state (lfm2): slots, checkpoints, chunk borders.

For a model without recurrent layers every method here is a no-op (and `reserve_at_admission` is 0),
so the loop calls them unconditionally. For a hybrid model, per request:

    admit         its state slot; the state of the checkpoint its match ends at is written into it; where
                  its prompt leaves a cached sequence beyond that checkpoint, a checkpoint position
    align_chunk   a prefill chunk ends at the next checkpoint position (scheduler/checkpoints.py)
    reserve       the step that reaches such a position reserves a device slot for its checkpoint
    after a step  the state at that position is copied out (held by the allocation until release)
    release       the state after the last computed token goes with the blocks into the tree

Chunks are aligned whether or not the cache is on, so cache on and off compute the same chunks.
"""
from __future__ import annotations

import logging
import math

from scheduler.checkpoint_store import CheckpointStore
from scheduler.checkpoints import Checkpoints

log = logging.getLogger("strata.cache")


def create_checkpoints(runner, disk, every_blocks: int) -> Checkpoints | None:
    """The cache's checkpoint bookkeeping for the runner's model (None: it has no recurrent state)."""
    states = runner.states
    if not states.enabled:
        return None
    units = max(1, math.ceil(states.state_bytes / runner.layout.bytes_per_block))
    store = CheckpointStore(states.shape, disk.dir if disk is not None else None, disk.key if disk is not None else b"")
    return Checkpoints(units, every_blocks, store)


def load_checkpoint_index(cache) -> int:
    """Attach the checkpoint files found at start-up to the disk blocks they belong to (after
    load_disk_index), within the disk budget; the others are deleted. Returns checkpoints attached."""
    ckpt = cache.ckpt
    if not ckpt.enabled:
        return 0
    attached = 0
    for key in ckpt.store.scan():
        node = cache._on_disk.get(key[0])
        fits = len(cache._on_disk) + ckpt.units_on("disk") + ckpt.units <= cache.disk_blocks
        if node is None or not 0 < key[1] <= len(node.tokens) or not fits:
            ckpt.store.delete("disk", key)
            continue
        node.checkpoints.add(key[1])
        ckpt.nodes[id(node)] = node
        attached += 1
    log.info("conversation cache: %d state checkpoints loaded from disk", attached,
             extra={"fields": {"loaded_checkpoints": attached}})
    return attached


class HybridSteps:
    """Recurrent-state bookkeeping of the running requests (see the module docstring)."""

    def __init__(self, runner, cache):
        self.runner, self.cache = runner, cache
        self.enabled = runner.states.enabled
        self.keeps_checkpoints = self.enabled and cache.enabled and cache.ckpt.enabled

    @property
    def reserve_at_admission(self) -> int:
        return 1 if self.keeps_checkpoints else 0  # the checkpoint taken at release

    def _positions(self, request) -> list[int]:
        if not self.enabled:
            return []
        return self.cache.ckpt.positions(request.prompt_len, self.runner.block_size, request.checkpoint_positions)

    def align_chunk(self, request, n: int) -> int:
        """The chunk of n tokens cut short so it ends at the next checkpoint position."""
        start = request.seq.num_computed
        return next((p - start for p in self._positions(request) if start < p < start + n), n)

    def checkpoints_after(self, request, n: int) -> int:
        """Checkpoints the request's next step of n tokens takes (0 or 1)."""
        if not self.keeps_checkpoints:
            return 0
        return int(request.seq.num_computed + n in self._positions(request))

    def admit(self, request, match) -> None:
        """Its state slot and state. Where its prompt left a cached sequence (the K/V match went further than
        the last checkpoint), it will take a checkpoint too: that is where the next variant branches off."""
        if not self.enabled:
            return
        if match.kv_tokens > match.num_tokens and request.seq.num_computed == match.num_tokens:
            request.checkpoint_positions = tuple(sorted({*request.checkpoint_positions, match.kv_tokens}))
        seq, allocation = request.seq, request.allocation
        self.runner.states.slot_of(seq)  # on the loop's thread, before any step of it
        if allocation.checkpoint_state is not None:
            self.runner.states.write(seq, allocation.checkpoint_state)
            allocation.checkpoint_state = None
        assert seq.num_computed == 0 or self.keeps_checkpoints, "a cached prefix without its state"

    def take_checkpoints(self, work) -> None:
        """After a step: copy out the states at the checkpoint positions it reached."""
        if not self.keeps_checkpoints:
            return
        for request, _ in work:
            allocation, seq = request.allocation, request.seq
            if allocation is None or seq.num_computed not in self._positions(request):
                continue
            if len(allocation.pending_checkpoints) + 1 < allocation.checkpoints_reserved:
                self.cache.ckpt.take(allocation, seq.num_computed, self.runner.states.read(seq))

    def final_state(self, request):
        """The state after the request's computed tokens, for its release (None: nothing to keep)."""
        if not self.keeps_checkpoints or request.seq.num_computed == 0:
            return None
        return self.runner.states.read(request.seq)

    def release(self, request) -> None:
        if self.enabled and request.seq is not None:
            self.runner.states.release(request.seq)
