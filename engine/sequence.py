"""A sequence being computed, and the runner that advances several of them in one batched step.

There is no prefill or decode phase: a sequence has token_ids and num_computed (tokens whose K/V is in
its blocks). A step computes the next `n` uncomputed tokens of each chosen sequence; n = 1 on a sequence
with one pending token is a decode step, a larger n a prefill chunk. One rule covers both.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from engine.batch import BatchMeta, build_batch
from engine.kv import BLOCK_SIZE, BlockAllocator, blocks_needed, layout_for
from engine.model import Model
from engine.recurrent_state import RecurrentStates
from engine.stages import Stage, split_layers


@dataclass
class Sequence:
    """Token ids (prompt + generated) and where their K/V lives."""

    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    state_slot: int = -1  # hybrid models: its row of the runner's recurrent-state pools (-1: none yet)
    # hybrid models: tokens before num_computed its next step runs again from zero states, reading their
    # cached K/V and writing none, to recompute the state at num_computed (engine/state_window.py)
    state_window: int = 0

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed


class ModelRunner:
    """Owns a model's KV pools; runs one batched forward over chosen sequences.

    Block ids have one owner at a time. Under the server the conversation cache owns them
    (`claim_blocks`), and `ensure_blocks` / `release` then refuse; without one (`strata generate`, tests,
    benchmarks) those two hand out ids from a free list the runner makes on first use.

    With a layer split (engine/stages.py) the pools are per stage; one allocator hands out block ids that
    are valid in every stage's pool, and every block operation (copy, park, restore, read, write) acts on
    all stages, so the conversation cache sees one block whatever the split.
    """

    def __init__(self, model: Model, num_blocks: int, block_size: int = BLOCK_SIZE, host_blocks: int = 0,
                 layer_split: tuple[int, ...] = (), kv_type: str = "f32", device_blocks: int | None = None):
        """device_blocks: an elastic pool's starting size (num_blocks ids reserved, this many backed; the
        engine loop's device_min_blocks); None for a fixed pool of num_blocks."""
        self.model = model
        self.device_blocks = device_blocks
        self.block_size = block_size
        # whole model: accounting, disk tier; kv_type is resolved (engine/kv.resolve_kv_type), never "auto"
        self.layout = layout_for(model.config, num_blocks, block_size, kv_type)
        self.host_layout = replace(self.layout, num_blocks=host_blocks)
        self.stages = [self._make_stage(i, layers, num_blocks, host_blocks)
                       for i, layers in enumerate(split_layers(model.config.n_layers, layer_split))]
        self.states = RecurrentStates(model.config, self.stages)  # hybrid models only; else holds nothing
        self._standalone: BlockAllocator | None = None  # block ids for runs without a conversation cache
        self.blocks_owner: str | None = None

    def claim_blocks(self, owner: str) -> None:
        """Hand every block id to `owner` (the conversation cache); standalone tables are refused from now on."""
        assert self._standalone is None or self._standalone.num_free == self.layout.num_blocks, \
            "block ids are already in standalone use"
        self.blocks_owner, self._standalone = owner, None

    @property
    def allocator(self) -> BlockAllocator:
        """The standalone free list (runs without a conversation cache)."""
        assert self.blocks_owner is None, f"this runner's block ids belong to the {self.blocks_owner}"
        if self._standalone is None:
            self._standalone = BlockAllocator(self.layout.num_blocks)
        return self._standalone

    def _make_stage(self, index: int, layers: range, num_blocks: int, host_blocks: int) -> Stage:
        backend = self.model.backend.for_stage(index)  # CUDA: the same weights and arena, a stream of its own
        kv = _kv_layers(self.model.config, layers)
        layout = replace(self.layout, n_layers=kv.stop - kv.start)
        # host_blocks are committed now; the host tier grows from there as the cache's admission grants.
        host_pool = backend.create_host_pool(replace(layout, num_blocks=host_blocks))
        # Block moves run on the event loop while the stage's worker may be computing another group's step
        # (on blocks no step uses): a backend with per-thread state gives them a handle of their own.
        pool = backend.create_kv_pool(layout) if self.device_blocks is None else \
            backend.create_kv_pool(layout, mapped_blocks=self.device_blocks)
        return Stage(index, layers, backend, layout, pool, host_pool, backend.sibling())

    @property
    def kv_pool(self):
        """The whole model's pool when there is one stage (tests and tools that read it directly)."""
        if len(self.stages) != 1:
            raise AttributeError("kv_pool is per stage with a layer split: use runner.stages[i].kv_pool")
        return self.stages[0].kv_pool

    @property
    def host_pool(self):
        return self.stages[0].host_pool if len(self.stages) == 1 else [s.host_pool for s in self.stages]

    def check_stages(self) -> None:
        """The stages' invariants (part of the cache's integrity check): their layers cover the model once,
        in order, and every stage's device and host pool holds the same block ids."""
        layers = [i for stage in self.stages for i in stage.layers]
        assert layers == list(range(self.model.config.n_layers)), f"stage layers {layers}"
        for stage in self.stages:
            assert stage.layout.num_blocks == self.layout.num_blocks, f"{stage.describe()}: device pool size"
            kv = _kv_layers(self.model.config, stage.layers)
            assert stage.layout.n_layers == kv.stop - kv.start, f"{stage.describe()}: pool layers"
            assert stage.host_pool.num_blocks == self.host_layout.num_blocks, f"{stage.describe()}: host pool"

    def grow_host(self, num_blocks: int) -> None:
        """Commit host-tier slots up to num_blocks in every stage (granted by the memory admission)."""
        for stage in self.stages:
            stage.mover.grow_host_pool(stage.host_pool, num_blocks)
        self.host_layout = replace(self.host_layout, num_blocks=num_blocks)

    def resize_device(self, num_blocks: int) -> None:
        """The elastic pool's size changed (scheduler/cache/device_pool.py): ids num_blocks and up are unused now,
        so every stage's pool may give their memory back (a backend that commits memory as it is touched
        needs nothing to grow). The pools keep addressing every reserved id, so no block id changes."""
        assert 0 < num_blocks <= self.layout.num_blocks, f"pool size {num_blocks} beyond the reserved ids"
        for stage in self.stages:
            stage.mover.release_kv_blocks(stage.kv_pool, num_blocks)

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens; False (nothing changed) when the pool is full."""
        missing = blocks_needed(num_tokens, self.block_size) - len(seq.block_table)
        if missing <= 0:
            return True
        fresh = self.allocator.allocate(missing)
        if fresh is None:
            return False
        seq.block_table.extend(fresh)
        return True

    def move_blocks(self, parks, restores, copies) -> None:
        """Run a cache allocation's copies in the order that keeps them safe: device -> host parks, then
        host -> device restores, then device -> device copy-on-write. Only between a block's steps, and in
        every stage."""
        for stage in self.stages:
            backend = stage.mover
            if parks:
                backend.park_blocks(stage.kv_pool, stage.host_pool, parks)
            if restores:
                backend.restore_blocks(stage.host_pool, stage.kv_pool, restores)
            if copies:
                backend.copy_blocks(stage.kv_pool, copies)
        self._fence_moves()

    def _fence_moves(self) -> None:
        """Each stage's next step after the block moves just queued, in device order where the backend has
        streams (cuda: the stage's stream waits on the mover's event; numpy moves are done on return)."""
        for stage in self.stages:
            if stage.mover.capabilities.queued_moves and stage.mover is not stage.backend:
                stage.backend.wait_for(stage.mover.move_fence(), stage.mover)

    def apply_moves(self, parks, restores, writes, copies) -> None:
        """A granted plan's block moves in one call: parks (device -> host), restores (host -> device),
        writes ((device block, K, V) read from disk), copies (copy-on-write), in that order, every stage.
        A restore whose host slot a park takes over in the same call is read first (a swap)."""
        parked_slots = {slot for _, slot in parks}
        swapped = [(device_id, *self.read_block("host", slot)) for slot, device_id in restores if slot in parked_slots]
        self.move_blocks(parks, [(s, d) for s, d in restores if s not in parked_slots], [])
        writes = swapped + list(writes)
        for device_id, k, v in writes:
            self.write_block(device_id, k, v)
        if copies:
            self.move_blocks([], [], copies)

    def read_block(self, tier: str, index: int):
        """Copy of one block's stored (K, V) from the device or the host pools, as numpy [layers, KVH, B, row]
        (rows as engine/kv_quant.py stores them: int8 rows carry their scales)."""
        parts = [s.mover.read_block(s.kv_pool if tier == "device" else s.host_pool, index) for s in self.stages]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([k for k, _ in parts]), np.concatenate([v for _, v in parts])

    def write_block(self, device_id: int, k, v) -> None:
        for stage in self.stages:
            layers = _kv_layers(self.model.config, stage.layers)
            stage.mover.write_block(stage.kv_pool, device_id, k[layers], v[layers])
        self._fence_moves()

    def release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        self.states.release(seq)

    def prepare(self, work: list[tuple[Sequence, int]], all_logits: bool = False) -> BatchMeta:
        """The batch that computes the next n pending tokens of each (sequence, n); blocks must already be
        reserved with ensure_blocks."""
        items = []
        slots = [self.states.slot_of(seq) for seq, _ in work] if self.states.enabled else None
        windows = [seq.state_window for seq, _ in work]
        assert not any(windows) or self.states.window_tokens, "a state window on a runner that has none"
        for seq, n in work:
            assert 0 < n <= seq.num_pending, f"asked for {n} tokens of a sequence with {seq.num_pending} pending"
            start = seq.num_computed - seq.state_window  # the window's rows come first
            items.append((seq.token_ids[start : seq.num_computed + n], start,
                          np.asarray(seq.block_table, dtype=np.int32)))
        return build_batch(items, self.block_size, all_logits=all_logits, state_slots=slots,
                           state_windows=windows if any(windows) else None)

    def run_stage(self, stage: Stage, batch: BatchMeta, hidden):
        """One stage's share of a forward: embeds on the first stage, applies the head on the last (then
        returns host logits), otherwise returns the hidden state for the next stage."""
        model, backend, last = self.model, stage.backend, stage.layers.stop == self.model.config.n_layers
        if stage.is_first and last and stage.state_pool is None:
            return backend.run_forward(model, batch, stage.kv_pool)  # cuda: graph replay of decode steps
        if stage.is_first:
            hidden = model.embed(batch, backend)
        else:  # cuda: into this stage's own workspace, on its stream
            hidden = backend.receive_hidden(hidden, batch)
        hidden = model.run_layers(hidden, batch, stage.kv_pool, stage.layers, backend, stage.state_pool)
        if last:
            return model.head(hidden, backend)
        # The hand-off buffer: a stage's workspace is reused by its next job while the next stage still
        # reads this one. cuda launched from the loop hands over its device arrays with their event (the next
        # stage copies them DtoD, ordered by cuStreamWaitEvent both ways), otherwise a host copy; numpy hands
        # over its arrays as they are.
        return backend.send_hidden(hidden)

    @staticmethod
    def commit(work: list[tuple[Sequence, int]]) -> None:
        """Count the tokens a finished forward computed (their K/V is now in the blocks); a state window
        ran with them is done."""
        for seq, n in work:
            seq.num_computed += n
            seq.state_window = 0

    def step(self, work: list[tuple[Sequence, int]], all_logits: bool = False) -> np.ndarray:
        """Compute the next n pending tokens of each (sequence, n) through every stage in turn; returns
        logits rows (one per sequence, its last computed token, unless all_logits)."""
        batch = self.prepare(work, all_logits)
        hidden = None
        for stage in self.stages:
            hidden = self.run_stage(stage, batch, hidden)
        self.commit(work)
        return hidden


def _kv_layers(config, layers: range) -> slice:
    """The K/V-pool layers of a stage's layer range (all of them, unless some are recurrent)."""
    return slice(config.kv_index(layers.start), config.kv_index(layers.stop))
