"""The expert cache's figures (`cache_stats`, for /metrics and the log) and its log line at most every 30 s.

Every name says expert_cache: these count MoE expert weights found in device slots, never prompt reuse.
"""
from __future__ import annotations

import logging
import time

from engine.units import MIB

log = logging.getLogger("strata.expert_cache")
LOG_INTERVAL_S = 30.0


def cache_stats(cache) -> dict:
    """expert_cache_* figures of an ExpertCache (counters since start; per layer hits/misses). The caller
    holds the cache's lock."""
    counts = {} if cache.slots is None else cache.slots.counts
    hits = sum(c.hits for c in counts.values())
    misses = sum(c.misses for c in counts.values())
    return {
        "expert_cache_slots": cache.num_slots,
        "expert_cache_slots_used": len(cache.slots.resident()) if cache.slots else 0,
        "expert_cache_slot_bytes": cache.slot_bytes if cache.layers else 0,
        "expert_cache_device_bytes": cache.device_bytes, "expert_cache_host_bytes": cache.host_arena_bytes,
        "expert_cache_hits": hits, "expert_cache_misses": misses,
        "expert_cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "expert_cache_loads": cache.loads, "expert_cache_loaded_bytes": cache.loaded_bytes,
        "expert_cache_wait_seconds": cache.wait_seconds,
        "expert_cache_routing_sync_seconds": cache.routing_sync_seconds,
        "expert_cache_held_bytes": cache.budget.holder.held_bytes if cache.budget else cache.device_bytes,
        "expert_cache_grows": cache.num_grows, "expert_cache_shrinks": cache.num_shrinks,
        "expert_cache_layers": {layer: (c.hits, c.misses) for layer, c in sorted(counts.items())},
    }


class HitRateLog:
    """The hit-rate line of an ExpertCache, at most every LOG_INTERVAL_S; it keeps the time and counters of
    the last line (the figures of a line are those since the one before)."""

    def __init__(self):
        self._last = (time.monotonic(), 0, 0)

    def maybe_log(self, cache) -> None:
        """Log the line when LOG_INTERVAL_S has passed since the last one (takes the cache's stats)."""
        now = time.monotonic()
        last_time, last_hits, last_misses = self._last
        if now - last_time < LOG_INTERVAL_S:
            return
        s = cache.stats()
        hits, misses = s["expert_cache_hits"] - last_hits, s["expert_cache_misses"] - last_misses
        self._last = (now, s["expert_cache_hits"], s["expert_cache_misses"])
        if hits + misses:
            _log_line(s, hits, misses, now - last_time)


def _log_line(s: dict, hits: int, misses: int, seconds: float) -> None:
    log.info("expert cache (MoE weights, not the prompt cache): %.0f%% of %d expert uses found on the "
             "device in the last %.0f s; %d loads, %.0f MiB moved, %.2f s waited in all; %d slots (%.0f MiB), "
             "%d grows, %d shrinks", 100.0 * hits / (hits + misses), hits + misses, seconds,
             s["expert_cache_loads"], s["expert_cache_loaded_bytes"] / MIB, s["expert_cache_wait_seconds"],
             s["expert_cache_slots"], s["expert_cache_device_bytes"] / MIB, s["expert_cache_grows"],
             s["expert_cache_shrinks"], extra={"fields": {k: v for k, v in s.items() if k != "expert_cache_layers"}})
