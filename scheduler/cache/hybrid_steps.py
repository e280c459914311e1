"""The engine loop's part in a hybrid model's recurrent state (lfm2): slots, checkpoints, chunk borders.

For a model without recurrent layers every method here is a no-op (and `reserve_at_admission` is 0),
so the loop calls them unconditionally. For a hybrid model, per request:

    admit         its state slot; the state of the checkpoint its match ends at is written into it, or (lfm2,
                  no checkpoint near the K/V match's end) zeros and a state window its first step runs
                  (engine/state_window.py); where its prompt leaves a cached sequence, a checkpoint position
    reserve       a step that passes checkpoint positions (scheduler/cache/checkpoints.py) reserves a device
                  slot for each, and asks the state pools to capture the state there (inside the chunk)
    after a step  the captured states are held by the allocation until release
    release       the state after the last computed token goes with the blocks into the tree

Chunks are never cut for a checkpoint, so cache on and off compute the same chunks.
"""
from __future__ import annotations

from engine.kv import blocks_needed
from scheduler.cache.checkpoint_spacing import most_useful


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
        return self.cache.ckpt.positions(request.prompt_len, self.runner.block_size,
                                         (*request.checkpoint_positions, *request.checkpoint_guesses), request.line_starts)

    def _passed(self, request, n: int) -> tuple[int, ...]:
        start = request.seq.num_computed
        first = start if request.seq.state_window else start + 1  # a window's step yields the state at start too
        return tuple(p for p in self._positions(request) if first <= p <= start + n)

    def checkpoints_after(self, request, n: int) -> int:
        """Checkpoints the request's next step of n tokens takes: those it passes, as many as the device
        could hold beside the step's blocks (the loop asks for these or none, so a step that passes more
        than fit would keep none; take_checkpoints then keeps the most useful)."""
        if not self.keeps_checkpoints:
            return 0
        return min(len(self._passed(request, n)), self._room_for_checkpoints(request, n))

    def _room_for_checkpoints(self, request, n: int) -> int:
        """Checkpoint slots the device has at most for this step: free and movable slots, and the pool's
        growth room, less the step's new blocks (an upper bound: a plan may still find less)."""
        cache = self.cache
        fresh = max(0, blocks_needed(request.seq.num_computed + n, self.runner.block_size)
                    - len(request.allocation.block_table))
        slots = cache.tiers.free_slots("device") + cache.index.device_weight \
            + max(0, cache.admission.device_ceiling_blocks - cache.num_blocks) - fresh
        return max(0, slots) // cache.ckpt.units

    def before_step(self, work) -> None:
        """Ask for the states at the checkpoint positions each scheduled step passes."""
        if not self.keeps_checkpoints:
            return
        for request, n in work:
            positions = self._passed(request, n)
            if positions:
                self.runner.states.capture(request.seq, positions)

    def admit(self, request, match) -> None:
        """Its state slot and state. Where its prompt left a cached sequence (the K/V match went further than
        the last checkpoint), it will take a checkpoint too: that is where the next variant branches off."""
        if not self.enabled:
            return
        seq, allocation = request.seq, request.allocation
        branch = seq.num_computed if allocation.state_window else \
            match.kv_tokens if match.kv_tokens > match.num_tokens == seq.num_computed else 0
        if branch:
            request.checkpoint_positions = tuple(sorted({*request.checkpoint_positions, branch}))
        self.runner.states.slot_of(seq)  # on the loop's thread, before any step of it
        if allocation.checkpoint_state is not None:
            self.runner.states.write(seq, allocation.checkpoint_state)
            allocation.checkpoint_state = None
        elif allocation.state_window:
            self.runner.states.start_window(seq)  # its first step recomputes the state (engine/state_window.py)
        assert seq.num_computed == 0 or self.keeps_checkpoints, "a cached prefix without its state"

    def take_checkpoints(self, work) -> None:
        """After a step: the states it captured join the request's pending checkpoints."""
        if not self.keeps_checkpoints:
            return
        for request, _ in work:
            allocation = request.allocation
            captured = self.runner.states.take_captured(request.seq)
            if allocation is None:
                continue
            held = allocation.pending_checkpoints  # from earlier chunks: before these
            start = max(held, default=allocation.cached_tokens)
            branch = {p for p in captured if self._branch_point(request, p)}
            for position in most_useful(captured, start, branch):  # when fewer slots than states, these first
                if len(held) + 1 < allocation.checkpoints_reserved:
                    self.cache.ckpt.take(allocation, position, captured[position], position in branch)

    @staticmethod
    def _branch_point(request, position: int) -> bool:
        """Where prompts branch: a message start, where the prompt left a cached sequence, the prompt's end.
        When a step has fewer slots than states these go first (then the later ones), and they are the
        last a request short of room gives up."""
        return position in request.checkpoint_positions or position == request.prompt_len - 1

    def final_state(self, request):
        """The state after the request's computed tokens, for its release (None: nothing to keep)."""
        if not self.keeps_checkpoints or request.seq.num_computed == 0 or request.seq.state_window:
            return None  # (a window not run yet: the slot holds zeros, not the state)
        return self.runner.states.read(request.seq)

    def release(self, request) -> None:
        if self.enabled and request.seq is not None:
            self.runner.states.release(request.seq)
