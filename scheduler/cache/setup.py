"""The engine's conversation cache, built on its runner's pools: one owner of the block ids, the memory
admission's budgets, the elastic pool's range, and what the disk tier kept from the last run."""
from __future__ import annotations

import logging
import math

from engine.sequence import ModelRunner
from scheduler.cache.block_mover import EngineBlockMover
from scheduler.cache.checkpoint_store import CheckpointStore
from scheduler.cache.checkpoints import Checkpoints
from scheduler.cache.persistence import load_checkpoint_index, load_disk_index
from scheduler.cache.checkpoint_spacing import resolve_spacing
from scheduler.cache.device_pool import SEGMENT_BLOCKS
from scheduler.cache.disk_tier import DiskTier
from scheduler.memory.admission import MemoryAdmission
from scheduler.cache.prefix_cache import PrefixCache

log = logging.getLogger("strata.cache")


def create_cache(runner: ModelRunner, disk: DiskTier | None, admission: MemoryAdmission | None, *, enabled: bool,
                 device_min_blocks: int | None, active_window_s: float, checkpoint_every: int | None) -> PrefixCache:
    """Claims the runner's block ids for the cache. An elastic device pool (device_min_blocks below the
    ids the runner reserved) starts at device_min_blocks and grows up to them; a fixed pool's size is the
    whole device budget. Without an admission the host tier is what the runner committed at start, fixed.
    checkpoint_every: --state-checkpoint-every in blocks, None for auto (scheduler/cache/checkpoint_spacing.py)."""
    runner.claim_blocks("conversation cache")  # one owner of block ids: the cache's allocator
    block_bytes = runner.layout.bytes_per_block
    admission = admission or MemoryAdmission(runner.host_layout.num_blocks, block_bytes)
    assert admission.host_committed_blocks == runner.host_layout.num_blocks, "runner and admission disagree"
    if admission.block_bytes != block_bytes:  # no host tier: create_admission had no block size to take (1)
        assert not admission.host_budget_blocks, f"block bytes {admission.block_bytes} != the runner's {block_bytes}"
        admission.block_bytes = block_bytes  # the device budget and its holders count in real blocks
    reserved = runner.layout.num_blocks
    if device_min_blocks is not None and device_min_blocks < reserved:
        admission.set_device_pool(device_min_blocks, reserved, SEGMENT_BLOCKS)
    else:
        admission.device_budget_bytes = reserved * block_bytes
    cache = PrefixCache(device_min_blocks or reserved, runner.block_size, enabled=enabled,
                        host_blocks=admission.host_budget_blocks, disk_blocks=disk.capacity_blocks if disk else 0,
                        mover=EngineBlockMover(runner, disk), block_bytes=block_bytes, admission=admission,
                        active_window_s=active_window_s,
                        checkpoints=create_checkpoints(runner, disk, _spacing(runner, checkpoint_every)))
    if disk is not None and enabled:
        load_disk_index(cache, disk.scan())
        load_checkpoint_index(cache)
    return cache


def _spacing(runner: ModelRunner, requested: int | None) -> int:
    """Periodic checkpoint spacing in blocks for a hybrid model (logged with its reason); 0 for other models."""
    if not runner.states.enabled:
        return 0
    spacing = resolve_spacing(requested, runner.states.state_bytes, runner.layout.bytes_per_block, runner.block_size)
    log.info("%s", spacing.describe(), extra={"fields": {"state_checkpoint_every": spacing.every_blocks,
                                                    "state_checkpoint_bytes": spacing.state_bytes}})
    return spacing.every_blocks


def create_checkpoints(runner, disk, every_blocks: int) -> Checkpoints | None:
    """The cache's checkpoint bookkeeping for the runner's model (None: it has no recurrent state)."""
    states = runner.states
    if not states.enabled:
        return None
    units = max(1, math.ceil(states.state_bytes / runner.layout.bytes_per_block))
    store = CheckpointStore(states.shape, disk.dir if disk is not None else None, disk.key if disk is not None else b"")
    return Checkpoints(units, every_blocks, store, window_tokens=states.window_tokens)
