"""Building one server's engine from a loaded model and its settings: memory sized, admission, runner, loop.

    settings + loaded model
      -> the device KV pool's size          memory/sizing.size_kv_pool (--kv-cache-mib N | MIN:MAX | auto)
      -> the host tier's budget              memory/sizing.plan_memory, counting the engine once (its own figure)
      -> the running admission              memory/sizing.create_admission (committed now or on demand)
      -> runner, disk tier, metrics, EngineLoop
      -> the engine's other memory users     each through one budget holder of the loop's MemoryService
                                             (the MoE expert cache: holder "moe_experts")

The api layer (api/serve.py) loads the model, resolves --ctx-size and builds the chat protocol, then calls
`create_engine`; what it gets back is the one narrow object it talks to (EngineLoop) and the metrics.
"""
from __future__ import annotations

import logging
from typing import Protocol

from engine.backends.cuda.expert_cache.budget import HOLDER_NAME, connect_expert_budget
from engine.kv import BLOCK_SIZE, blocks_needed, layout_for, resolve_kv_type
from engine.loader import LoadedModel
from engine.sequence import ModelRunner
from engine.units import MIB
from scheduler.cache.disk_tier import DiskTier, model_file_identity
from scheduler.engine_loop import EngineLoop
from scheduler.engine_views import tier_budgets
from scheduler.memory.sizing import PoolSize, create_admission, plan_memory, size_kv_pool
from scheduler.metrics import Metrics

log = logging.getLogger("strata.serve")


class EngineConfig(Protocol):
    """The settings an engine is built from, as the server's configuration (api/config.ServerConfig) has them."""

    kv_type: str
    batch: int
    prefill_chunk: int
    prefill_step_tokens: int
    max_queue: int
    progress_interval_s: float
    conversation_cache_mib: int
    conversation_cache_commit: str
    conversation_cache_min_free_mib: int
    conversation_cache_dir: str | None
    conversation_cache_disk_mib: int
    conversation_cache_write_behind_mib_s: float
    conversation_active_s: float

    @property
    def kv_cache_range_mib(self) -> tuple[int, int] | None: ...

    @property
    def layer_cuts(self) -> tuple[int, ...]: ...

    @property
    def checkpoint_every_blocks(self) -> int | None: ...

    def groups_for(self, num_stages: int) -> int: ...


def create_engine(config: EngineConfig, loaded: LoadedModel, ctx_size: int, *,
                  hidden_token_ids: frozenset[int] = frozenset()) -> tuple[EngineLoop, Metrics]:
    """The engine loop of one server and its metrics, every memory budget sized and granted (the expert
    cache's slots made). Raises ValueError saying what to change when the memory does not fit."""
    backend = loaded.model.backend
    kv_type = resolve_kv_type(config.kv_type, backend)
    bytes_per_block = layout_for(loaded.model.config, 1, BLOCK_SIZE, kv_type).bytes_per_block
    on_host = backend.capabilities.on_host
    pool = size_kv_pool(config.kv_cache_range_mib, bytes_per_block=bytes_per_block,
                        slot_blocks=blocks_needed(ctx_size, BLOCK_SIZE), batch=config.batch,
                        backend=backend, weight_bytes=loaded.info.weight_bytes if on_host else 0,
                        min_free_mib=config.conversation_cache_min_free_mib)
    # What the engine itself holds in host RAM: numpy keeps weights and KV there; cuda keeps them on the GPU.
    engine_host_bytes = loaded.info.weight_bytes + pool.reserved_blocks * bytes_per_block if on_host else 0
    expert_cache = backend.expert_cache if backend.capabilities.expert_cache else None  # --expert-cache-mib
    engine_host_bytes += expert_cache.host_arena_bytes if expert_cache is not None else 0  # its pinned experts
    plan = plan_memory(engine_host_bytes, config.conversation_cache_mib, config.conversation_cache_min_free_mib,
                       bytes_per_block)
    admission = create_admission(plan, config.conversation_cache_commit == "at-start",
                                 config.conversation_cache_min_free_mib)
    runner = ModelRunner(loaded.model, pool.reserved_blocks, BLOCK_SIZE, host_blocks=admission.host_committed_blocks,
                         layer_split=config.layer_cuts, kv_type=kv_type, device_blocks=pool.min_blocks)
    groups = config.groups_for(len(runner.stages))
    if len(runner.stages) > 1 or groups > 1:
        log.info("pipeline: %s; %d batch groups of slots move through them staggered",
                 ", ".join(s.describe() for s in runner.stages), groups)
    host = admission.snapshot(0)
    log.info("memory: engine %d MiB; host tier budget %d MiB (%d blocks), committed %d MiB (%s), used %d MiB; "
             "limit %d MiB of which %d MiB in use elsewhere (%s)", plan.engine_bytes // MIB,
             host["host_budget_mib"], plan.host_blocks, host["host_committed_mib"], config.conversation_cache_commit,
             host["host_used_mib"], plan.machine.limit_bytes // MIB, plan.machine.in_use_bytes // MIB,
             plan.machine.source, extra={"fields": host})
    metrics = Metrics()
    if expert_cache is not None:
        metrics.watch_expert_cache(expert_cache)
    disk = _disk_tier(config, loaded, runner) if config.conversation_cache_dir else None
    engine = EngineLoop(runner, loaded.tokenizer, num_slots=config.batch, prefill_chunk=config.prefill_chunk,
                        prefill_step_tokens=config.prefill_step_tokens, max_queue=config.max_queue, metrics=metrics,
                        progress_interval_s=config.progress_interval_s,
                        disk=disk, batch_groups=groups, admission=admission,
                        write_behind_mib_s=config.conversation_cache_write_behind_mib_s,
                        conversation_active_s=config.conversation_active_s, device_min_blocks=pool.min_blocks,
                        state_checkpoint_every=config.checkpoint_every_blocks, hidden_token_ids=hidden_token_ids)
    if expert_cache is not None:  # its slots granted by the memory admission, beside the KV pool
        connect_expert_budget(expert_cache, engine.memory.register_budget(HOLDER_NAME),
                              loaded.model.config.n_experts_used, is_idle=lambda: not engine.in_flight)
    _log_pool(engine, pool, config.batch, ctx_size)
    return engine, metrics


def _log_pool(engine: EngineLoop, pool: PoolSize, batch: int, ctx_size: int) -> None:
    """The start-up lines of the KV pool and of every tier's budget."""
    layout, num_blocks = engine.runner.layout, engine.cache.num_blocks
    log.info("KV pool: %d blocks of %d tokens (%.0f MiB) for %d slots of %d tokens; K/V %s, %d bytes per token",
             num_blocks, BLOCK_SIZE, num_blocks * layout.bytes_per_block / MIB, batch, ctx_size, layout.kv_type,
             layout.bytes_per_token, extra={"fields": {"kv_type": layout.kv_type, "kv_blocks": num_blocks,
                                                       "kv_bytes_per_token": layout.bytes_per_token}})
    tiers = tier_budgets(engine)
    log.info("memory tiers (MiB, budget / committed / used): %s; device pool sized by %s",
             "; ".join(f"{name} {t['budget_mib']} / {t['committed_mib']} / {t['used_mib']}"
                       for name, t in tiers.items()), pool.rule, extra={"fields": {"tiers": tiers}})


def _disk_tier(config: EngineConfig, loaded: LoadedModel, runner: ModelRunner) -> DiskTier:
    """The disk tier, keyed by the model file's identity and everything that changes the KV bytes."""
    # The backend actually running (never "auto"): KV written by numpy and by cuda may differ in the last bits.
    return DiskTier.for_layout(config.conversation_cache_dir, model_file_identity(loaded.path),
                               loaded.model.backend.name, runner.layout, int(config.conversation_cache_disk_mib * MIB))
