"""The expert cache's /metrics (MoE expert weights in device slots, engine/backends/cuda/expert_cache/cache.py).

Every name says expert_cache, never just "cache" or "hit": these count expert weights found on the GPU, not prompt
tokens reused, and an operator must not read a 95% expert hit rate as prompt reuse (seed 003).
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge


class ExpertCacheMetrics:
    """Mirrors ExpertCache.stats() (counters since start) into a registry when asked (`observe`)."""

    def __init__(self, registry, cache):
        self.cache = cache
        r = registry
        self.uses = Counter("strata_expert_cache_uses", "MoE expert uses by layer and whether the expert was already "
                            "in a device slot (hit) or copied in (miss); expert weights, not prompt tokens",
                            ["layer", "result"], registry=r)
        self.hit_rate = Gauge("strata_expert_cache_hit_rate", "Share of MoE expert uses found in a device slot since "
                              "start, by layer", ["layer"], registry=r)
        self.loaded_bytes = Counter("strata_expert_cache_loaded_bytes", "Expert weight bytes copied host -> device",
                                    registry=r)
        self.loads = Counter("strata_expert_cache_loads", "Experts copied host -> device", registry=r)
        self.wait_seconds = Counter("strata_expert_cache_wait_seconds", "Time the compute stream waited for "
                                    "expert copies", registry=r)
        self.sync_seconds = Counter("strata_expert_cache_routing_sync_seconds", "Host time reading each MoE "
                                    "layer's routing back (the step's needed experts)", registry=r)
        self.slots = Gauge("strata_expert_cache_slots", "Device expert slots", ["state"], registry=r)
        self.bytes = Gauge("strata_expert_cache_bytes", "Expert cache memory", ["where"], registry=r)
        self.resizes = Counter("strata_expert_cache_resizes", "Expert cache resizes granted by the memory "
                               "admission (shrink: the KV pool needed the room; grow: it was spare again)",
                               ["direction"], registry=r)
        self._last: dict = {}

    def observe(self) -> None:
        s = self.cache.stats()
        for layer, (hits, misses) in s["expert_cache_layers"].items():
            self._inc(self.uses.labels(str(layer), "hit"), ("hit", layer), hits)
            self._inc(self.uses.labels(str(layer), "miss"), ("miss", layer), misses)
            self.hit_rate.labels(str(layer)).set(hits / (hits + misses) if hits + misses else 0.0)
        for counter, key in ((self.loaded_bytes, "expert_cache_loaded_bytes"), (self.loads, "expert_cache_loads"),
                             (self.wait_seconds, "expert_cache_wait_seconds"),
                             (self.sync_seconds, "expert_cache_routing_sync_seconds")):
            self._inc(counter, key, s[key])
        self._inc(self.resizes.labels("grow"), "expert_cache_grows", s["expert_cache_grows"])
        self._inc(self.resizes.labels("shrink"), "expert_cache_shrinks", s["expert_cache_shrinks"])
        self.slots.labels("total").set(s["expert_cache_slots"])
        self.slots.labels("used").set(s["expert_cache_slots_used"])
        self.bytes.labels("device").set(s["expert_cache_device_bytes"])
        self.bytes.labels("host_pinned").set(s["expert_cache_host_bytes"])
        self.bytes.labels("device_held").set(s["expert_cache_held_bytes"])  # granted by the memory admission

    def _inc(self, counter, key, value: float) -> None:
        delta = value - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = value
