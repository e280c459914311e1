"""The last finished requests, as GET /requests and the dashboard show them: what each prompt reused (by tier)
and computed, its time to first token, and, when it reused less than the cache once held, where and why.

The record is the per-request log line's fields (scheduler/output.py builds both from one dict), plus the
miss explanation of that request and the wall-clock time it finished. Bounded; mutated on the event loop only.
"""
from __future__ import annotations

from collections import deque

MAX_REQUESTS = 256


def miss_summary(miss: dict, described: str) -> dict:
    """The JSON shape of a miss explanation (scheduler/cache/explain.py): its cause and token position, the
    message there (``where``: "message 3 (user)"), and the cause's own facts (which tier an eviction took and
    when, which cached conversation a divergence left, how many earlier turns an unseen one carried)."""
    keep = ("cause", "position", "evicted_at", "tier", "reason", "conversation", "earlier_turns", "disk_tokens",
            "window", "checkpoint", "kv_tokens")
    return {**{k: miss[k] for k in keep if k in miss}, "where": described}


class RequestHistory:
    """The last ``capacity`` finished requests, oldest first."""

    def __init__(self, capacity: int = MAX_REQUESTS):
        self._records: deque[dict] = deque(maxlen=capacity)

    def add(self, record: dict) -> None:
        """One finished request (its summary fields; see the module docstring)."""
        self._records.append(record)

    def snapshot(self, conversation: str | None = None, limit: int = MAX_REQUESTS) -> list[dict]:
        """The newest ``limit`` records, newest first; only conversation ``conversation``'s when given."""
        out = []
        for record in reversed(self._records):
            if conversation is None or record.get("conversation") == conversation:
                out.append(dict(record))
                if len(out) >= limit:
                    break
        return out
