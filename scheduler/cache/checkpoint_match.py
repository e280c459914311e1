"""Where a hybrid model's cached prefix ends: the K/V match cut back to a state checkpoint, or (lfm2) kept
whole with a state window (engine/state_window.py). Called as `Checkpoints.trim`.

    K/V match   ────────────────────────────────────> p
    checkpoint  ──────────────────> c
    p - c <= W: reuse up to c, restore its state, compute p - c tokens again (K/V too)
    p - c >  W: reuse up to p (K/V of every token), recompute the state from [p - W, p): W tokens

W = 0 (qwen3next, or no model support): always the first. Equal cost goes to the checkpoint, which is
bitwise exact where the window is exact only to float rounding. c may lie on a shared block, on a child of
the last one that agrees with the prompt, or (first trim only) on a sibling of a shared block within the
tokens they share (the partial block a request copied and extended still holds the earlier reply's end).
"""
from __future__ import annotations

from scheduler.cache.tree import CachedBlock, PrefixMatch, common_prefix_len


def trim(match: PrefixMatch, window_tokens: int, rest: list[int] | None = None,
         root: CachedBlock | None = None) -> PrefixMatch:
    """The longest prefix of `match` whose end carries a checkpoint (nothing when none does), unless a state
    window costs less (then `match` itself, with `state_window` and `nearest_checkpoint` set). With `rest`
    (the prompt's tokens after the shared blocks, up to the match limit) and the root, every child of the
    last shared block that agrees with `rest` is a candidate, not only the copy source: siblings that agree
    equally far (prompts that branched at the same token) may differ in their checkpoints. `window_tokens`:
    the model's state window (0: none). Called for a model with checkpoints only."""
    best, pos = None, 0
    for i, node in enumerate(match.shared):
        for holder, common in _block_and_siblings(node, rest is not None):
            for k in holder.checkpoints:
                if k <= common and (best is None or pos + k > best[0]):
                    best = (pos + k, i, holder, k)
        pos += len(node.tokens)
    source = match.cow_source
    parent = match.shared[-1] if match.shared else root
    candidates = [(source, match.cow_tokens)] if source is not None else []
    if rest is not None and parent is not None:
        candidates = [(c, common_prefix_len(c.tokens, rest)) for c in parent.children.values() if c.checkpoints]
    for child, common in candidates:
        for k in child.checkpoints:
            if k <= common and (best is None or pos + k > best[0]):
                best = (pos + k, len(match.shared), child, k)
    kv_tokens, salt, conv = match.num_tokens, match.salt, match.conversation
    nearest = best[0] if best is not None else 0
    if window_tokens and kv_tokens - nearest > window_tokens:  # a window costs less
        out = PrefixMatch(list(match.shared), match.cow_source, match.cow_tokens, salt, conv)
        out.kv_tokens, out.state_window, out.nearest_checkpoint = kv_tokens, window_tokens, nearest
        return out
    if best is None:
        out = PrefixMatch([], None, 0, salt, conv)
    elif best[1] < len(match.shared) and best[2] is match.shared[best[1]] and best[3] == len(best[2].tokens):
        # a full shared block's end
        out = PrefixMatch(match.shared[: best[1] + 1], None, 0, salt, conv)
    else:  # inside a block, the partial block's end or a sibling's checkpoint: that block's head is copied
        out = PrefixMatch(match.shared[: best[1]], best[2], best[3], salt, conv)
    if best is not None:
        out.checkpoint = (best[2], best[3])
    out.kv_tokens = kv_tokens
    return out


def _block_and_siblings(node: CachedBlock, siblings: bool):
    """(node, its length), then (`siblings`) each sibling that carries checkpoints with the tokens it shares
    with node: a sibling's state after k <= shared tokens is the state at that position of this path too
    (the same parent, so the same prefix and salt). A request that copied a partial block and extended it
    leaves the partial one, with the earlier reply's end state, beside the full one (fan-out under
    pressure). Only in a match's first trim: a re-trim (a disk read or checkpoint file that failed) keeps
    to blocks whose bytes the plan has read already."""
    yield node, len(node.tokens)
    parent = node.parent
    if not siblings or parent is None:
        return
    for sibling in parent.children.values():
        if sibling is not node and sibling.checkpoints:
            yield sibling, common_prefix_len(sibling.tokens, node.tokens)

