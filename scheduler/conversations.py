"""The conversations clients name (``prompt_cache_key``, Claude Code's session id), as /cache shows them
beside what the cache holds of every conversation (scheduler/cache/conversation_activity.py).

A named conversation's turns are tracked so an operator can read, per conversation, how much of each turn
was reused: one entry per key (most recently used last), bounded, updated when a request finishes.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

MAX_CONVERSATIONS = 256
_EMPTY = {"active": False, "last_use_s": 0.0, "tokens": {"device": 0, "host": 0, "disk": 0}}  # nothing cached


@dataclass
class ConversationStats:
    key: str
    turns: int = 0
    last_request_id: str = ""
    last_prompt_tokens: int = 0
    last_cached_tokens: int = 0
    prompt_tokens: int = 0  # over every turn
    cached_tokens: int = 0  # over every turn
    last_seen_s: float = 0.0  # wall clock


class ConversationLog:
    """Bounded LRU of named conversations. Mutated only on the event loop."""

    def __init__(self, capacity: int = MAX_CONVERSATIONS):
        self.capacity = capacity
        self._entries: OrderedDict[str, ConversationStats] = OrderedDict()

    def record(self, key: str, request_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        """One finished turn of conversation ``key``."""
        stats = self._entries.pop(key, None) or ConversationStats(key)
        stats.turns += 1
        stats.last_request_id = request_id
        stats.last_prompt_tokens, stats.last_cached_tokens = prompt_tokens, cached_tokens
        stats.prompt_tokens += prompt_tokens
        stats.cached_tokens += cached_tokens
        stats.last_seen_s = time.time()
        self._entries[key] = stats
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        """Whether a turn of conversation ``key`` finished here since start (among the last `capacity`)."""
        return key in self._entries

    def snapshot(self, cached: list[dict] = ()) -> list[dict]:
        """Every tracked conversation, most recently used first, joined by key with what the cache holds of
        each (`cached`: ConversationActivity.snapshot, unnamed conversations included)."""
        holding = {c["key"]: c for c in cached}
        out = []
        for stats in reversed(self._entries.values()):
            entry = {**_EMPTY, **holding.pop(stats.key, {}), **asdict(stats), "named": True}
            out.append(entry)
        out += [{**_EMPTY, **c} for c in holding.values()]
        return sorted(out, key=lambda c: -max(c.get("last_seen_s", 0.0), c["last_use_s"]))
