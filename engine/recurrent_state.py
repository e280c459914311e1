"""Per-sequence recurrent state of a hybrid model, beside the K/V pools of the runner.

A running sequence owns one state slot: the same row in every stage's state pool (each stage keeps the
states of its own recurrent layers, as it keeps the K/V of its own attention layers). The state is the
sequence's position-`num_computed` summary of every recurrent layer; unlike K/V it cannot be cut back to
an earlier position, so the conversation cache keeps copies of it ("checkpoints", scheduler/) and a
sequence that resumes from a cached prefix gets one written into its slot (`write`). A sequence at
position 0 starts from zeros whatever its slot holds (the ops check start_pos), so a slot is never
cleared. For models without recurrent layers this object holds nothing and every call is a no-op.

    stage 0 pool: conv[l] [slots, L-1, d] for its recurrent layers l      slot s = one running sequence
    stage 1 pool: ...
    read(seq) / write(seq, state): state [recurrent layers of the model, L-1, d] in layer order
    (qwen3next, engine/gated_deltanet.py: [recurrent layers, 1, conv rows + delta-rule matrix] flattened)
"""
from __future__ import annotations

import numpy as np

from engine.config import ModelConfig
from engine.gated_deltanet import DeltaNetStatePool
from engine.state_window import state_window_tokens


class RecurrentStates:
    """State slots of the runner's sequences over the stages' state pools (created here, one per stage)."""

    def __init__(self, config: ModelConfig, stages: list):
        self.enabled = config.is_hybrid
        self.stages = stages
        self._free: list[int] = []
        self._next = 0
        self.window_tokens = 0  # > 0: the state at p can be recomputed from [p - this, p) (start_window)
        if not self.enabled:
            return
        if all(stage.backend.capabilities.writes_kv_rows for stage in stages):  # else checkpoints only
            self.window_tokens = state_window_tokens(config)
        for stage in stages:
            layers = tuple(i for i in stage.layers if config.layer_is_recurrent[i])
            stage.state_pool = _state_pool(config, layers, stage.backend)
        if config.delta_net is not None:  # qwen3next: conv rows and the delta-rule matrix, flattened
            self.shape = (len(config.recurrent_layers), 1, config.delta_net.state_floats)
        else:
            self.shape = (len(config.recurrent_layers), config.conv_kernel - 1, config.d_model)

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's state (one checkpoint), every stage."""
        return int(np.prod(self.shape)) * 4 if self.enabled else 0

    @property
    def num_slots(self) -> int:
        return self._next - len(self._free)

    def slot_of(self, seq) -> int:
        """The sequence's slot, taking a free one on first use."""
        if seq.state_slot < 0:
            seq.state_slot = self._free.pop() if self._free else self._take_new()
        return seq.state_slot

    def _take_new(self) -> int:
        slot, self._next = self._next, self._next + 1
        for stage in self.stages:
            stage.state_pool.ensure_slot(slot)
        return slot

    def release(self, seq) -> None:
        """Give the sequence's slot back (its bytes stay until a later sequence overwrites them)."""
        if self.enabled and seq.state_slot >= 0:
            assert seq.state_slot not in self._free, f"state slot {seq.state_slot} freed twice"
            self._free.append(seq.state_slot)
            for stage in self.stages:  # a failed step may have left a capture behind
                pool = stage.state_pool
                pool.capture.pop(seq.state_slot, None)
                for key in [k for k in pool.captured if k[0] == seq.state_slot]:
                    del pool.captured[key]
        seq.state_slot = -1

    def read(self, seq) -> np.ndarray:
        """Copy of the sequence's state after its computed tokens: [recurrent layers, L-1, d]."""
        slot = self.slot_of(seq)
        return np.concatenate([stage.state_pool.read(slot) for stage in self.stages])

    def capture(self, seq, positions: tuple[int, ...]) -> None:
        """Have the sequence's next step copy out its state after each of `positions` (inside that step)."""
        slot = self.slot_of(seq)
        for stage in self.stages:
            stage.state_pool.capture[slot] = tuple(positions)

    def take_captured(self, seq) -> dict[int, np.ndarray]:
        """The states its last step captured, position -> [recurrent layers, L-1, d]; clears the request."""
        slot, out = seq.state_slot, {}
        for position in self.stages[0].state_pool.capture.pop(slot, ()):
            parts = [stage.state_pool.take_captured(slot, position) for stage in self.stages]
            out[position] = np.concatenate(parts)
        for stage in self.stages[1:]:
            stage.state_pool.capture.pop(slot, None)
        return out

    def start_window(self, seq) -> None:
        """Have the sequence's next step recompute its state at num_computed from window_tokens tokens before
        it (their K/V cached), starting from zero states (engine/state_window.py)."""
        assert 0 < self.window_tokens <= seq.num_computed, f"no state window at {seq.num_computed}"
        self.write(seq, np.zeros(self.shape, np.float32))
        seq.state_window = self.window_tokens

    def write(self, seq, state: np.ndarray) -> None:
        """Load a checkpoint into the sequence's slot (the state after its num_computed tokens)."""
        assert state.shape == self.shape, f"checkpoint of shape {state.shape}, the model's state is {self.shape}"
        slot, start = self.slot_of(seq), 0
        for stage in self.stages:
            count = len(stage.state_pool.layers)
            stage.state_pool.write(slot, state[start : start + count])
            start += count


def _state_pool(config: ModelConfig, layers: tuple[int, ...], backend):
    if config.delta_net is not None:
        return DeltaNetStatePool(layers, config.delta_net)
    return backend.create_state_pool(layers, config.conv_kernel, config.d_model)  # cuda: on the device
