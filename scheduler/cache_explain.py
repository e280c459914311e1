"""Why a prompt reused no more than it did: where it diverged from a cached sequence, or which eviction
took the rest (from the digests the cache remembers of what it dropped)."""
from __future__ import annotations

from scheduler.cache_tree import CachedBlock, PrefixMatch, block_digest, common_prefix_len, conversation_id


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
