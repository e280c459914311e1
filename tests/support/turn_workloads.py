"""Conversation workloads for the cache tests, as (conversation, user tokens, max reply tokens) turns, and
the ideal a perfect cache computes: shared by the engine-loop workload tests (tests/test_cache_workloads.py,
test_memory_*.py) and the hybrid models' (tests/test_hybrid_cache.py, test_qwen3next_cache.py)."""
import numpy as np

from scheduler.cache.tree import common_prefix_len

# A user list starting with HEAD_SWAP replaces the conversation's first HEAD_LEN tokens by the rest of the list
# first (a prompt head that toggles between two tool lists).
HEAD_SWAP, HEAD_LEN = -1, 30


def ideal_computed(prompt, cached_sequences):
    """Tokens a perfect cache computes: all but the longest prefix any earlier finished request left behind
    (the last prompt token is always computed: its logits give the first new token)."""
    best = max((common_prefix_len(prompt, c) for c in cached_sequences), default=0)
    return len(prompt) - min(best, len(prompt) - 1)


def random_turns(seed, conversations=4, count=18):
    """`count` turns of 1-29 random user tokens and 1-8 reply tokens, each in one of `conversations`."""
    rng = np.random.default_rng(seed)
    turns = []
    for _ in range(count):
        conv = int(rng.integers(conversations))
        user = rng.integers(3, 250, size=int(rng.integers(1, 30))).tolist()
        turns.append((conv, user, int(rng.integers(1, 9))))
    return turns


def agent_turns():
    """Two long conversations alternating, a short unrelated request between turns, and conversation 1's
    head toggling between two tool lists every turn."""
    head_a, head_b = list(range(10, 40)), list(range(100, 130))
    turns = []
    for turn in range(5):
        turns.append((0, (head_a if turn == 0 else []) + [50 + turn] * (9 + turn), 5))
        swap = [HEAD_SWAP] + (head_b if turn % 2 else head_a)
        turns.append((1, (head_a if turn == 0 else swap) + [70 + turn] * (6 + turn), 5))
        turns.append((2 + turn, [200 + turn, 201, 202], 2))  # short one-off request
    return turns
