"""What the conversation cache says when it loses something: drops remembered for explaining misses, and
"tier full" episodes reported once with the setting that would have kept everything.

A composed object with its own state (PrefixCache holds one as `drops`); it never touches the cache's tiers.
"""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict

from engine.units import MIB

log = logging.getLogger("strata.cache")
_DROPPED_HISTORY = 65536  # digests of dropped blocks kept for explaining misses (16 bytes each)
_FLAGS = {"device": "--kv-cache-mib", "host": "--conversation-cache-mib", "disk": "--conversation-cache-disk-mib"}


class DropLog:
    """Dropped digests (bounded) and the open "tier full" episodes."""

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        self.dropped: OrderedDict[bytes, tuple[float, str, str]] = OrderedDict()  # digest -> when, tier, why
        self._full_episode: dict[str, int] = {}  # tier -> blocks dropped since it filled up

    def record(self, digests: list[bytes], tier: str, reason: str, conversation: str, tokens: int,
               tier_total: int) -> None:
        now = time.time()
        for digest in digests:
            self.dropped[digest] = (now, tier, reason)
        while len(self.dropped) > _DROPPED_HISTORY:
            self.dropped.popitem(last=False)
        self._report_full(tier, len(digests), tier_total)
        log.info("evicted %d cached tokens of %s from the %s tier: %s", tokens, conversation, tier, reason,
                 extra={"fields": {"conversation": conversation, "tokens": tokens, "tier": tier, "reason": reason}})

    def _report_full(self, tier: str, dropped_blocks: int, total: int) -> None:
        """Say once per episode that a budget is full, with the setting that would have kept everything."""
        first = tier not in self._full_episode
        self._full_episode[tier] = self._full_episode.get(tier, 0) + dropped_blocks
        if not first:
            return
        need_mib = max(1, math.ceil((total + dropped_blocks) * self.block_bytes / MIB))
        log.warning("the %s tier of the conversation cache is full (%d blocks): cached conversations are being "
                    "dropped; %s %.0f or more would have kept them (the figure grows as long as this lasts)",
                    tier, total, _FLAGS[tier], need_mib,
                    extra={"fields": {"tier": tier, "blocks": total, "flag": _FLAGS[tier]}})

    def end_episodes(self, free_fraction: dict[str, float]) -> None:
        for tier in [t for t in self._full_episode if free_fraction[t] > 0.1]:
            log.info("the %s tier has room again after dropping %d blocks", tier, self._full_episode.pop(tier))
