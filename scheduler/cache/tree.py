"""The tree the conversation cache is made of: one node per KV block, child of the block before it.

A node's identity is its parent + its tokens (kept, so a hit is verified, never trusted to a hash).
Where its bytes live is per node: on the device (`device_id`), parked in host RAM (`host_slot`), or on
disk; only the tiers (scheduler/cache/tiers.py) set those. Policy (who moves, who is dropped) is in the
planner (scheduler/cache/planner.py); this file only holds and answers questions about the tree: `Tree`
matches and inserts, and knows nothing of tiers.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(eq=False)
class CachedBlock:
    tokens: tuple[int, ...]
    parent: "CachedBlock | None"
    children: dict[tuple[int, ...], "CachedBlock"] = field(default_factory=dict)
    device_id: int = -1
    host_slot: int = -1
    ref_count: int = 0
    last_used: int = 0
    digest: bytes = b""  # chain digest of everything up to and including this block (names it on disk)
    on_disk: bool = False  # the block's only copy is its file in the disk tier
    disk_copy: bool = False  # resident on the device or host, with a verified file on disk too (write-behind)
    checkpoints: set[int] = field(default_factory=set)  # hybrid models: k where the state after k tokens is kept

    @property
    def on_device(self) -> bool:
        return self.device_id >= 0

    @property
    def on_host(self) -> bool:
        return self.host_slot >= 0

    @property
    def tier(self) -> str:
        return "device" if self.on_device else "host" if self.on_host else "disk"

    def path(self) -> list["CachedBlock"]:
        """Blocks from the first one of the sequence down to this one."""
        out, node = [], self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def subtree(self) -> list["CachedBlock"]:
        out, stack = [], [self]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


@dataclass
class PrefixMatch:
    """Result of a match: shared full blocks, plus an optional block whose head is reused by copy."""

    shared: list[CachedBlock]
    cow_source: CachedBlock | None
    cow_tokens: int
    salt: str = ""
    conversation: str | None = None  # the client's name for it (prompt_cache_key, session id), if any
    # hybrid models (scheduler/cache/checkpoints.py): the checkpoint the match ends at, and the K/V match length
    checkpoint: tuple[CachedBlock, int] | None = None
    kv_tokens: int = 0
    # lfm2: no checkpoint near the K/V match's end, so the state there is recomputed from this many tokens
    # before it (engine/state_window.py; checkpoint is None); where the nearest checkpoint was (0: none)
    state_window: int = 0
    nearest_checkpoint: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(b.tokens) for b in self.shared) + self.cow_tokens


class Tree:
    """The roots (one per cache salt; roots of salts not seen yet in this run are created by digest for
    blocks loaded from disk) and the links under them. Pure: tokens and links only, no tier."""

    def __init__(self):
        self._roots: dict[str, CachedBlock] = {}
        self._roots_by_digest: dict[bytes, CachedBlock] = {}

    def root(self, salt: str) -> CachedBlock:
        """The root of `salt` (created on first use)."""
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = self.root_for_digest(root_digest(salt))
        return root

    def root_for_digest(self, digest: bytes) -> CachedBlock:
        """The root node with this digest (created on first use, e.g. by blocks loaded from disk)."""
        root = self._roots_by_digest.get(digest)
        if root is None:
            root = self._roots_by_digest[digest] = CachedBlock((), None, digest=digest)
        return root

    def roots(self) -> list[CachedBlock]:
        """Every root, in the order they were created."""
        return list(self._roots_by_digest.values())

    def match(self, salt: str, token_ids: list[int], limit: int, block_size: int) -> PrefixMatch:
        """The longest prefix of token_ids[:limit] under `salt`'s root (`longest_match`). Changes nothing."""
        return longest_match(self.root(salt), token_ids, limit, block_size)

    @staticmethod
    def insert(parent: CachedBlock, tokens: tuple[int, ...], digest: bytes | None = None) -> CachedBlock:
        """A new node for `tokens` under `parent` (which has no child of these tokens yet), its digest
        chained from the parent's unless given (a file's, which names the same chain)."""
        assert tokens not in parent.children, "a child of these tokens is cached already"
        block = CachedBlock(tokens, parent, digest=digest or block_digest(parent.digest, tokens))
        parent.children[tokens] = block
        return block

    @staticmethod
    def detach(block: CachedBlock) -> None:
        """Unlink `block` (and so everything under it) from its parent."""
        del block.parent.children[block.tokens]


def longest_match(root: CachedBlock, token_ids: list[int], limit: int, block_size: int) -> PrefixMatch:
    """Walk full blocks while they match exactly, then take the child agreeing longest with the rest."""
    node, shared, pos = root, [], 0
    while pos + block_size <= limit:
        child = node.children.get(tuple(token_ids[pos : pos + block_size]))
        if child is None or len(child.tokens) != block_size:
            break
        shared.append(child)
        node, pos = child, pos + block_size
    best, best_len = None, 0
    rest = token_ids[pos:limit]
    for child in node.children.values():
        common = common_prefix_len(child.tokens, rest)
        if common > best_len:
            best, best_len = child, common
    return PrefixMatch(shared, best, best_len)


def block_digest(parent_digest: bytes, tokens: tuple[int, ...] | list[int]) -> bytes:
    """Digest of a block given its parent's: the hash chain that names a prefix (tokens kept beside it)."""
    data = parent_digest + b"".join(int(t).to_bytes(4, "little") for t in tokens)
    return hashlib.blake2b(data, digest_size=16).digest()


def root_digest(salt: str) -> bytes:
    """Each cache_salt (or tenant key) has its own root, so different salts never share a block."""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"strata-root").digest()


def is_superseded(block: CachedBlock) -> bool:
    """A sibling extends this block's tokens: a reply tail that the next turn of the conversation grew."""
    n = len(block.tokens)
    return any(len(t) > n and t[:n] == block.tokens for t in block.parent.children)


def conversation_id(block: CachedBlock) -> str:
    """A stable name for the conversation a block belongs to: a digest of its first block's tokens."""
    first = block.path()[0]
    data = b"".join(t.to_bytes(4, "little", signed=False) for t in first.tokens)
    return "conv-" + hashlib.blake2b(data, digest_size=6).hexdigest()


def common_prefix_len(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
