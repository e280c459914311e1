"""Which cached blocks belong to an active conversation, so eviction takes one-off prompts' blocks first.

A conversation is named by the client (`prompt_cache_key` from Codex, Claude Code's session id; see
api/messages_api.py) or else by its first block (the same name `cache_tree.conversation_id` gives it in
the drop log). It is *active* while its last turn finished less than `window_s` ago, from its first turn
when the client named it, from its second when only its first block does (a prompt seen once is a
one-off). Each cached block belongs to the conversation that last released it; while that conversation is
active, the block ranks after every one-off prompt's block in each tier (scheduler/cache/eviction_index.py).

The activity changes only here: at a finished turn, and when `expire` finds a window passed. Both re-rank
the conversation's blocks (`on_change`), so the index never holds a stale class. Mutated on the event loop.
"""
from __future__ import annotations

import hashlib
import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

from scheduler.cache.tree import CachedBlock

ACTIVE_WINDOW_S = 300.0  # "a turn in the last few minutes": agents reply within seconds, people within minutes


@dataclass(eq=False)
class Conversation:
    name: str
    named: bool  # by the client; else by its first block
    turns: int = 0
    is_active: bool = False
    last_turn_s: float = 0.0  # monotonic, for the window
    last_use_wall_s: float = 0.0  # wall clock, for /cache
    blocks: set[CachedBlock] = field(default_factory=set)


def first_block_name(token_ids: list[int], block_size: int) -> str:
    """The name of an unnamed conversation: a digest of its first block's tokens (as conversation_id)."""
    data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids[:block_size])
    return "conv-" + hashlib.blake2b(data, digest_size=6).hexdigest()


class ConversationActivity:
    """Conversations by name, the blocks each owns, and whether each is active now."""

    def __init__(self, window_s: float = ACTIVE_WINDOW_S, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[set[CachedBlock]], None] = lambda blocks: None):
        self.window_s = window_s  # 0 turns the preference off: every block ranks as a one-off prompt's
        self.clock = clock
        self.on_change = on_change  # re-rank these blocks (their conversation's class changed)
        self._by_name: dict[str, Conversation] = {}
        self._owner: dict[CachedBlock, Conversation] = {}
        self._deadlines: list[tuple[float, str]] = []  # (last turn + window, name); stale entries skipped

    def is_active(self, block: CachedBlock) -> bool:
        conversation = self._owner.get(block)
        return conversation is not None and conversation.is_active

    def conversation(self, name: str, named: bool) -> Conversation:
        found = self._by_name.get(name)
        if found is None:
            found = self._by_name[name] = Conversation(name, named)
        found.named = found.named or named
        return found

    def for_release(self, name: str | None, token_ids: list[int], block_size: int, finished: bool):
        """The conversation a released request's blocks now belong to (named by the client, else by its
        first block); a finished turn (not a preemption) counts toward it. None for an empty request."""
        if not token_ids:
            return None
        conversation = self.conversation(name or first_block_name(token_ids, block_size), named=name is not None)
        if finished:
            self.finish_turn(conversation)
        return conversation

    def finish_turn(self, conversation: Conversation) -> None:
        """A turn of `conversation` finished now (call before its blocks are handed back)."""
        now = self.clock()
        conversation.turns += 1
        conversation.last_turn_s, conversation.last_use_wall_s = now, time.time()
        if self.window_s > 0 and conversation.turns >= (1 if conversation.named else 2):
            heapq.heappush(self._deadlines, (now + self.window_s, conversation.name))
            self._set_active(conversation, True)

    def own(self, block: CachedBlock, conversation: Conversation) -> None:
        """`block` now belongs to `conversation` (the caller re-syncs the block with the index)."""
        previous = self._owner.get(block)
        if previous is conversation:
            return
        if previous is not None:
            previous.blocks.discard(block)
            self.forget_if_unused(previous)
        self._owner[block] = conversation
        conversation.blocks.add(block)

    def forget(self, block: CachedBlock) -> None:
        """The block left the cache."""
        previous = self._owner.pop(block, None)
        if previous is not None:
            previous.blocks.discard(block)
            self.forget_if_unused(previous)

    def expire(self) -> None:
        """Conversations whose window has passed rank as one-off prompts again. O(expired x blocks)."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, name = heapq.heappop(self._deadlines)
            conversation = self._by_name.get(name)
            if conversation is not None and conversation.is_active and conversation.last_turn_s + self.window_s <= now:
                self._set_active(conversation, False)
                self.forget_if_unused(conversation)

    def snapshot(self, block_size: int, limit: int = 256) -> list[dict]:
        """Conversations owning cached blocks, most recently used first: tokens per tier, last use."""
        self.expire()
        found = sorted((c for c in self._by_name.values() if c.blocks), key=lambda c: -c.last_turn_s)[:limit]
        out = []
        for c in found:
            tokens = {"device": 0, "host": 0, "disk": 0}
            for block in c.blocks:
                tokens[block.tier] += len(block.tokens)
            out.append({"key": c.name, "named": c.named, "active": c.is_active, "turns": c.turns,
                        "last_use_s": c.last_use_wall_s, "tokens": tokens})
        return out

    def check(self, cached: set[CachedBlock]) -> None:
        """Every owned block is cached and in its owner's set; no conversation lingers without blocks unless
        active (tests: with the cache's integrity check)."""
        assert all(block in cached and block in c.blocks for block, c in self._owner.items()), \
            "a conversation owns a block the cache no longer holds"
        assert sum(len(c.blocks) for c in self._by_name.values()) == len(self._owner), "conversation sets disagree"
        assert all(c.blocks or c.is_active for c in self._by_name.values()), "an idle conversation without blocks"

    def _set_active(self, conversation: Conversation, active: bool) -> None:
        if conversation.is_active != active:
            conversation.is_active = active
            self.on_change(conversation.blocks)

    def forget_if_unused(self, conversation: Conversation) -> None:
        """Forget a conversation that owns no block and is not active (its turns counted no further)."""
        if not conversation.blocks and not conversation.is_active:
            self._by_name.pop(conversation.name, None)
