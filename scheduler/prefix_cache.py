"""The conversation cache's device tier: a tree of KV blocks with token-exact longest-prefix reuse.

Each node is one KV block holding up to B tokens, child of the block before it in its sequence; a node's
identity is its parent + its tokens (kept, so a hit is verified, never trusted to a hash). Full blocks are
shared in place. A prompt that diverges inside a block, or ends inside one, reuses that block's matching
tokens through copy-on-write: the block is copied to a fresh block the request owns, so a shared block is
never written. Many variants of a conversation coexist as branches (a toggling tool list hits both).

    root ── [sys prompt 0:16] ── [16:32] ── [32:48 turn 1] ── [48:57 reply tail, partial]
                                        └── [32:48 other conversation] ...

Blocks held by running requests are pinned (ref_count > 0). Unpinned blocks stay cached until the pool
needs room; then the least recently used unpinned leaf goes first, so shared heads outlive their branches.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.kv import BlockAllocator


@dataclass(eq=False)
class CachedBlock:
    block_id: int
    tokens: tuple[int, ...]
    parent: "CachedBlock | None"
    children: dict[tuple[int, ...], "CachedBlock"] = field(default_factory=dict)
    ref_count: int = 0
    last_used: int = 0

    @property
    def depth_tokens(self) -> int:
        """Tokens from the start of the sequence to the end of this block."""
        n, node = 0, self
        while node is not None:
            n, node = n + len(node.tokens), node.parent
        return n


@dataclass
class PrefixMatch:
    """Result of `match`: shared full blocks, plus an optional block to copy for a partial hit."""

    shared: list[CachedBlock]
    cow_source: CachedBlock | None
    cow_tokens: int  # tokens of cow_source reused (0 when none)

    @property
    def num_tokens(self) -> int:
        return sum(len(b.tokens) for b in self.shared) + self.cow_tokens


@dataclass
class Allocation:
    """A request's block table: shared cached blocks first, then blocks it owns."""

    block_table: list[int]
    num_shared: int
    cached_tokens: int
    copies: list[tuple[int, int]]  # (source block, destination block) to copy before the first step


class PrefixCache:
    """Owns every device block id: free, cached (unpinned, evictable) or in use (pinned)."""

    def __init__(self, num_blocks: int, block_size: int, enabled: bool = True):
        self.enabled = enabled  # off: nothing is ever matched or kept (the reference for tests)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = BlockAllocator(num_blocks)
        self._root = CachedBlock(-1, (), None)
        self._by_block: dict[int, CachedBlock] = {}
        self._clock = itertools.count(1)
        self._num_owned = 0  # fresh blocks handed to running requests, not yet in the tree
        self.evictions = 0

    # -- queries -------------------------------------------------------------------------------------
    def match(self, token_ids: list[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of token_ids, at most max_tokens long (callers pass len - 1 so the last
        prompt token is always computed). Does not change anything."""
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        if not self.enabled:
            limit = 0
        B, node, shared, pos = self.block_size, self._root, [], 0
        while pos + B <= limit:
            child = node.children.get(tuple(token_ids[pos : pos + B]))
            if child is None or len(child.tokens) != B:
                break
            shared.append(child)
            node, pos = child, pos + B
        best, best_len = None, 0
        rest = token_ids[pos:limit]
        for child in node.children.values():  # partial hit: the child agreeing longest with the rest
            common = _common_prefix_len(child.tokens, rest)
            if common > best_len:
                best, best_len = child, common
        return PrefixMatch(shared, best, best_len)

    @property
    def num_free(self) -> int:
        """Blocks obtainable now: never-used plus evictable cached ones."""
        return self._free.num_free + sum(1 for b in self._by_block.values() if b.ref_count == 0)

    @property
    def num_cached(self) -> int:
        return len(self._by_block)

    # -- mutations -----------------------------------------------------------------------------------
    def allocate(self, match: PrefixMatch, total_tokens: int) -> Allocation | None:
        """Pin the matched blocks and reserve fresh ones up to total_tokens; None (nothing changed) if the
        pool cannot make room without evicting pinned blocks."""
        needed = -(-total_tokens // self.block_size) - len(match.shared)
        for block in match.shared:  # pin first, so eviction below cannot take them
            self._pin(block)
        if match.cow_source is not None:
            self._pin(match.cow_source)
        fresh = self._take(needed)
        if match.cow_source is not None:
            self._unpin(match.cow_source)
        if fresh is None:
            for block in match.shared:
                self._unpin(block)
            return None
        self._num_owned += len(fresh)
        copies = [(match.cow_source.block_id, fresh[0])] if match.cow_source is not None else []
        table = [b.block_id for b in match.shared] + fresh
        return Allocation(table, len(match.shared), match.num_tokens, copies)

    def release(self, token_ids: list[int], num_computed: int, allocation: Allocation) -> None:
        """A request is done: its computed tokens' blocks join the tree (unpinned), the rest are freed."""
        B = self.block_size
        node = self._root
        for i, block_id in enumerate(allocation.block_table):
            start = i * B
            tokens = tuple(token_ids[start : min(start + B, num_computed)])
            if i < allocation.num_shared:
                node = self._by_block[block_id]
                self._unpin(node)
                continue
            self._num_owned -= 1
            if not tokens or not self.enabled:
                self._free.free([block_id])
                continue
            node = self._insert(node, tokens, block_id)

    def check_integrity(self) -> None:
        """free + cached + in use == total; tree links consistent; no block both free and cached."""
        self._free.check_integrity()
        free, cached = self._free.num_free, len(self._by_block)
        assert free + cached + self._num_owned == self.num_blocks, (
            f"free {free} + cached {cached} + in use {self._num_owned} != total {self.num_blocks}")
        assert not any(self._free._is_free[b] for b in self._by_block), "a block is both free and cached"
        for block_id, block in self._by_block.items():
            assert block.block_id == block_id and block.ref_count >= 0
            assert block.parent is not None and block.parent.children.get(block.tokens) is block
            assert 0 < len(block.tokens) <= self.block_size
            if len(block.tokens) < self.block_size:
                assert not block.children, "a partial block cannot have children"

    # -- internals -----------------------------------------------------------------------------------
    def _insert(self, parent: CachedBlock, tokens: tuple[int, ...], block_id: int) -> CachedBlock:
        existing = parent.children.get(tokens)
        if existing is not None:  # the same content is already cached: keep one copy
            self._free.free([block_id])
            existing.last_used = next(self._clock)
            return existing
        block = CachedBlock(block_id, tokens, parent, last_used=next(self._clock))
        parent.children[tokens] = block
        self._by_block[block_id] = block
        return block

    def _pin(self, block: CachedBlock) -> None:
        block.ref_count += 1
        block.last_used = next(self._clock)

    def _unpin(self, block: CachedBlock) -> None:
        assert block.ref_count > 0, f"block {block.block_id} unpinned more often than pinned"
        block.ref_count -= 1
        block.last_used = next(self._clock)

    def _take(self, count: int) -> list[int] | None:
        if count > self.num_free:
            return None
        while self._free.num_free < count:
            self._evict_one()
        return self._free.allocate(count)

    def _evict_one(self) -> None:
        # Least valuable first: a branch that a longer sibling of the same conversation has superseded
        # (a reply tail that the next turn extended), then the least recently used leaf.
        leaves = [b for b in self._by_block.values() if b.ref_count == 0 and not b.children]
        victim = min(leaves, key=lambda b: (not _is_superseded(b), b.last_used))
        del victim.parent.children[victim.tokens]
        del self._by_block[victim.block_id]
        self._free.free([victim.block_id])
        self.evictions += 1


def _is_superseded(block: CachedBlock) -> bool:
    n = len(block.tokens)
    return any(len(t) > n and t[:n] == block.tokens for t in block.parent.children)


def _common_prefix_len(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
