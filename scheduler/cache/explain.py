"""Why a prompt reused no more than it did: where it diverged from a cached sequence, which eviction took
the rest (from the digests the cache remembers of what it dropped), or that this replica never served the
named conversation whose earlier turns the prompt carries (they were computed on another replica)."""
from __future__ import annotations

from scheduler.cache.tree import CachedBlock, PrefixMatch, block_digest, common_prefix_len, conversation_id


def explain_miss(root: CachedBlock, token_ids: list[int], match: PrefixMatch, dropped: dict,
                 block_size: int) -> dict | None:
    """A dict with the cause ("evicted" / "diverged") and the position, or None for new content."""
    pos = match.num_tokens
    node = match.shared[-1] if match.shared else root
    block_start = len(match.shared) * block_size
    next_block = token_ids[block_start : block_start + block_size]
    if len(next_block) == block_size:
        drop = dropped.get(block_digest(node.digest, next_block))
        if drop is not None:
            when, tier, reason = drop
            return {"cause": "evicted", "position": block_start, "evicted_at": when, "tier": tier, "reason": reason}
    if node.children and pos < len(token_ids) - 1:
        nearest = max(node.children.values(), key=lambda c: common_prefix_len(c.tokens, next_block))
        common = common_prefix_len(nearest.tokens, next_block)
        if len(nearest.tokens) > common:
            return {"cause": "diverged", "position": block_start + common, "conversation": conversation_id(nearest)}
    return None


def explain_unseen(conversation_key: str | None, served_here: bool, earlier_turns: int, match: PrefixMatch,
                   disk_tokens: int = 0) -> dict | None:
    """The miss of a conversation that arrives with earlier turns at a replica that has not served it since
    it started (behind a router: its replica stopped, or the router moved it): cause "unseen", from the
    matched position, with the tokens of the match that came from the disk tier (written before a restart).
    None when the conversation is unnamed, new (no earlier turns), or was served here. Changes nothing."""
    if not conversation_key or served_here or earlier_turns == 0:
        return None
    return {"cause": "unseen", "position": match.num_tokens, "earlier_turns": earlier_turns,
            "disk_tokens": disk_tokens}
