"""Prometheus metrics of one server instance (its own registry, so tests can run several servers)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Counters and histograms the scheduler updates; `render()` gives the /metrics text."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("strata_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.reused_tokens = Counter("strata_reused_tokens", "Prompt tokens whose KV was reused", registry=r)
        self.computed_tokens = Counter("strata_computed_tokens", "Prompt tokens computed", registry=r)
        self.generated_tokens = Counter("strata_generated_tokens", "Tokens generated", registry=r)
        self.tool_calls_recovered = Counter(
            "strata_tool_calls_recovered", "Tool calls the model wrote as bare or fenced JSON, recovered as calls",
            ["shape"], registry=r)
        self.queue_depth = Gauge("strata_queue_depth", "Requests waiting for a slot", registry=r)
        self.slots_in_use = Gauge("strata_slots_in_use", "Slots holding a running request", registry=r)
        self.step_seconds = Histogram(
            "strata_step_seconds", "Duration of one engine step", ["kind"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft_seconds = Histogram(
            "strata_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.request_seconds = Histogram(
            "strata_request_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.stage_busy_seconds = Counter("strata_stage_busy_seconds", "Time each pipeline stage spent computing",
                                          ["stage"], registry=r)
        self.stage_queue_depth = Gauge("strata_stage_queue_depth", "Group steps waiting in front of each stage",
                                       ["stage"], registry=r)

        self.cache_blocks = Gauge("strata_cache_blocks", "Conversation cache blocks by tier and state",
                                  ["tier", "state"], registry=r)
        self.cache_events = Counter("strata_cache_events", "Parks, restores and drops of cached blocks",
                                    ["event"], registry=r)
        self.cache_moves = Counter("strata_cache_moves", "Block moves between tiers", ["op"], registry=r)
        self.cache_move_seconds = Counter("strata_cache_move_seconds", "Time spent moving blocks", ["op"],
                                          registry=r)
        self.cache_move_bytes = Counter("strata_cache_move_bytes", "Bytes of blocks moved", ["op"], registry=r)
        self._last_cache_stats: dict[str, float] = {}
        self._expert_cache = None  # scheduler/expert_cache_metrics.ExpertCacheMetrics (--expert-cache-mib)

    def watch_expert_cache(self, cache) -> None:
        """Export a cuda expert cache's expert_cache_* figures, read at every render."""
        from scheduler.expert_cache_metrics import ExpertCacheMetrics

        self._expert_cache = ExpertCacheMetrics(self.registry, cache)

    def observe_cache(self, usage: dict[str, int]) -> None:
        """Mirror the cache's usage figures (from PrefixCache.usage()) into gauges and counters."""
        self.cache_blocks.labels("device", "cached").set(usage["device_cached"])
        self.cache_blocks.labels("device", "in_use").set(usage["device_in_use"])
        self.cache_blocks.labels("device", "total").set(usage["device_total"])
        self.cache_blocks.labels("host", "cached").set(usage["host_cached"])
        self.cache_blocks.labels("host", "total").set(usage["host_total"])
        for event in ("parks", "restores", "spills", "disk_loads", "dropped_blocks", "dropped_tokens", "hits",
                      "misses", "miss_diverged", "miss_evicted"):
            self._inc(self.cache_events.labels(event), event, usage[event])
        self.cache_blocks.labels("disk", "cached").set(usage["disk_cached"])
        self.cache_blocks.labels("disk", "total").set(usage["disk_total"])
        for op, totals in usage.get("moves", {}).items():
            self._inc(self.cache_moves.labels(op), op + ":count", totals["count"])
            self._inc(self.cache_move_seconds.labels(op), op + ":seconds", totals["seconds"])
            self._inc(self.cache_move_bytes.labels(op), op + ":bytes", totals["bytes"])

    def _inc(self, counter, key: str, value: float) -> None:
        delta = value - self._last_cache_stats.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last_cache_stats[key] = value

    def render(self) -> bytes:
        if self._expert_cache is not None:
            self._expert_cache.observe()
        return generate_latest(self.registry)
