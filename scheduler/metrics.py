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

    def render(self) -> bytes:
        return generate_latest(self.registry)
