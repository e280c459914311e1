"""One request's whole life through the conversation cache, for the cache tests: match, allocate, release.

The last prompt token is never matched (its logits are always computed), as the engine does; each call ends
with the cache's integrity check, so a test that serves a few requests checks the state after every one.
"""
from __future__ import annotations

import numpy as np


def serve_request(cache, tokens: list[int], checkpoint: bool = False):
    """Serve `tokens` through `cache` (granted by its own admission) and return the allocation it had.

    With `checkpoint` (a hybrid model's request) it reserves a device slot for its final state, which its
    release attaches at its end: a state of the store's shape filled with len(tokens), so a test can tell
    which request's state a checkpoint holds."""
    match = cache.match(tokens, len(tokens) - 1)
    plan = cache.plan_allocate(match, len(tokens), checkpoints=int(checkpoint))
    assert plan is not None and cache.admission.grant(plan), "no room for the request"
    allocation = cache.apply(plan)
    final_state = np.full(cache.ckpt.store.shape, len(tokens), np.float32) if checkpoint else None
    cache.apply(cache.plan_release(tokens, len(tokens), allocation, final_state=final_state))
    cache.check_integrity()
    return allocation


def serve_request_via(service, cache, tokens: list[int]):
    """`serve_request` with both plans granted by a memory service (scheduler/memory/service.py) instead."""
    grant = service.grant(lambda: cache.plan_allocate(cache.match(tokens, len(tokens) - 1), len(tokens)))
    assert grant.granted
    assert service.grant(lambda: cache.plan_release(tokens, len(tokens), grant.allocation)).granted
    cache.check_integrity()
    return grant.allocation
