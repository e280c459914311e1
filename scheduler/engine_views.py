"""Read-only views of a running engine for the API's status endpoints (/slots, /cache, /pipeline,
/get_load) and its finished requests' metrics. Each reads the engine's parts as they are between steps
and changes nothing else."""
from __future__ import annotations

import time

from typing import TYPE_CHECKING

from engine.units import MIB
from scheduler.request import Request

if TYPE_CHECKING:
    from scheduler.engine_loop import EngineLoop


def tier_budgets(engine: "EngineLoop") -> dict[str, dict[str, int]]:
    """Budget, committed and used of every tier, in MiB (the start-up line and /cache):

        device  budget: the pool's reserve (elastic) or its size; committed: ids the pool hands out now;
                used: blocks holding K/V (cached or owned by running requests)
        host    budget: --conversation-cache-mib as clamped; committed: segments allocated; used: parked
        disk    budget: --conversation-cache-disk-mib; committed = used: block files (and copies)"""
    cache, admission = engine.cache, engine.cache.admission
    block = engine.runner.layout.bytes_per_block
    usage = cache.usage()
    mib = lambda blocks: blocks * block // MIB  # noqa: E731
    device_budget = max(cache.num_blocks, admission.device_reserved_blocks)
    # owned + pinned cached (device_in_use) + unpinned cached + the state checkpoints' slots (hybrid models)
    device_used = usage["device_in_use"] + cache.index.num_unpinned_device + cache.ckpt.units_on("device")
    disk_used = cache.disk_blocks - cache.disk_free  # block files, written-behind copies, checkpoint files
    return {"device": {"budget_mib": mib(device_budget), "committed_mib": mib(cache.num_blocks),
                       "used_mib": mib(device_used), "ceiling_mib": mib(usage["device_ceiling"]),
                       **{f"held_by_{n}_mib": b // MIB for n, b in admission.held_device_bytes.items()}},
            "host": {"budget_mib": usage["host_budget_mib"], "committed_mib": usage["host_committed_mib"],
                     "used_mib": usage["host_used_mib"]},
            "disk": {"budget_mib": mib(cache.disk_blocks), "committed_mib": mib(disk_used),
                     "used_mib": mib(disk_used)}}


def cache_snapshot(engine: "EngineLoop") -> dict:
    """The conversation cache for GET /cache: per tier cached / in use / total and budget / committed /
    used, moves and drops, and each conversation holding cached blocks (latest first): its tokens per
    tier, whether it is active, its last use, and for those clients named, their turns' reuse."""
    usage = engine.cache.usage()
    usage["block_size"] = engine.cache.block_size
    layout = engine.runner.layout
    usage["kv"] = {"type": layout.kv_type, "bytes_per_token": layout.bytes_per_token,
                   "bytes_per_block": layout.bytes_per_block}
    usage["tiers"] = tier_budgets(engine)
    usage["memory_requests_queued"] = engine.memory.num_queued
    usage["conversations"] = engine.conversations.snapshot(engine.cache.activity.snapshot(engine.cache.block_size))
    return usage


def pipeline_snapshot(engine: "EngineLoop") -> dict:
    """Stages (busy time, queue depth) and groups (row maps, where each is) for GET /pipeline."""
    groups = [{"group": g, "rows": [r.slot_id for r in engine.table.members(g)], "stage": engine.pipeline.where(g)}
              for g in range(engine.num_groups)]
    return {"stages": engine.pipeline.snapshot(), "groups": groups}


def load_snapshot(engine: "EngineLoop") -> dict:
    """Requests running and waiting, and the tokens they hold or will need (KV blocks of the running
    ones, prompts of the waiting ones): what a router balances on (GET /get_load)."""
    running = engine.table.running()
    held = sum(len(r.seq.block_table) * engine.runner.block_size for r in running if r.seq is not None)
    return {"running": len(running), "waiting": len(engine.table.waiting),
            "tokens": held + sum(r.prompt_len for r in engine.table.waiting)}


def slot_info(engine: "EngineLoop", slot_id: int, request: Request | None) -> dict:
    """One row of GET /slots."""
    if request is None:
        return {"id": slot_id, "state": "idle"}
    stage = engine.pipeline.where(request.group)
    stats = engine.pipeline.stats[stage] if stage is not None else None
    return {
        "id": slot_id,
        "state": "prefill" if request.is_prefilling else "decode",
        "request_id": request.request_id,
        "group": request.group,
        "pipeline_stage": stage,  # where this slot's group step is now, with that stage's load
        "stage_queue_depth": stats.queue_depth if stats else None,
        "stage_busy_seconds": round(stats.busy_seconds, 3) if stats else None,
        "prompt_tokens": request.prompt_len,
        "tokens_computed": request.seq.num_computed,
        "generated": len(request.output_ids),
        "kv_blocks": len(request.seq.block_table),
        "cached_tokens": request.cached_tokens,
        "tokens_held": len(request.seq.block_table) * engine.runner.block_size,
    }


def observe_finish(metrics, request: Request, reason: str, num_running: int) -> None:
    """A finished request's counters and timings in the Prometheus registry."""
    metrics.requests.labels(reason).inc()
    metrics.prompt_tokens.inc(request.prompt_len)
    metrics.reused_tokens.inc(request.cached_tokens)
    metrics.computed_tokens.inc(request.prompt_len - request.cached_tokens if request.prefill_done_s else 0)
    metrics.generated_tokens.inc(len(request.output_ids))
    metrics.request_seconds.observe(time.perf_counter() - request.arrival_s)
    metrics.slots_in_use.set(num_running)
