"""Conversation workloads through the engine loop on a tiny model: the cache never changes a token, and
computes exactly what is new (computed == ideal) when memory is ample; integrity after every step."""
import asyncio

import numpy as np
import pytest

from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request


@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("qwen3", seed=4, n_ctx=1024)


def _play(tiny, turns, cache_on, num_blocks=400, slots=3, concurrency=3, host_blocks=0):
    """Run the turns [(conversation, new user tokens, reply length)] `concurrency` at a time.

    Returns (replies, per-request (prompt_len, cached_tokens), the loop)."""
    model, tokenizer = tiny
    loop_holder = {}

    async def main():
        loop = EngineLoop(ModelRunner(model, num_blocks, 4, host_blocks=host_blocks), tokenizer, num_slots=slots, prefill_chunk=16,
                          max_queue=64, prefix_cache=cache_on, integrity_checks=True)
        loop_holder["loop"] = loop
        loop.start()
        history, replies, usage = {}, [], []
        for start in range(0, len(turns), concurrency):
            batch = turns[start : start + concurrency]
            streams = []
            for i, (conv, user, reply_len) in enumerate(batch):
                prompt = history.get(conv, []) + user
                params = SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True)
                streams.append((conv, prompt, loop.submit(Request(f"t{start + i}", prompt, params))))
            for conv, prompt, stream in streams:
                tokens, last = [], None
                async for delta in stream:
                    tokens += delta.token_ids
                    last = delta
                history[conv] = prompt + tokens
                replies.append(tokens)
                usage.append((len(prompt), last.usage.cached_tokens))
        await loop.shutdown(1)
        return replies, usage

    replies, usage = asyncio.run(main())
    return replies, usage, loop_holder["loop"]


def _random_turns(seed, conversations=4, count=18):
    rng = np.random.default_rng(seed)
    turns = []
    for _ in range(count):
        conv = int(rng.integers(conversations))
        user = rng.integers(3, 250, size=int(rng.integers(1, 30))).tolist()
        turns.append((conv, user, int(rng.integers(1, 9))))
    return turns


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_on_and_off_produce_identical_replies(tiny, seed):
    turns = _random_turns(seed)
    on, usage_on, loop = _play(tiny, turns, cache_on=True)
    off, usage_off, _ = _play(tiny, turns, cache_on=False)
    assert on == off
    assert sum(c for _, c in usage_on) > 0 and all(c == 0 for _, c in usage_off)
    loop.cache.check_integrity()


def test_alternating_conversations_compute_exactly_what_is_new(tiny):
    head = list(range(10, 40))  # shared system prompt
    turns = []
    for turn in range(4):
        for conv in (0, 1):
            user = (head if turn == 0 else []) + [50 + conv * 10 + turn] * (5 + turn)
            turns.append((conv, user, 6))
    _, usage, _ = _play(tiny, turns, cache_on=True, concurrency=1)
    computed = [p - c for p, c in usage]
    # ideal: turn 1 of conv 0 reads everything; conv 1's first turn reuses the shared head (30 tokens);
    # every later turn reads its new user tokens + the previous reply's last token (never computed).
    assert computed[0] == 35 and computed[1] == 35 - 30 + 0
    assert computed[2:] == [len(user) + 1 for _, user, _ in turns[2:]]


def test_memory_pressure_evicts_but_never_changes_replies(tiny):
    turns = _random_turns(7, conversations=5, count=24)
    small, _, loop = _play(tiny, turns, cache_on=True, num_blocks=70)
    off, _, _ = _play(tiny, turns, cache_on=False, num_blocks=70)
    assert small == off and loop.cache.stats["dropped_blocks"] > 0


def test_device_pressure_with_a_host_tier_parks_and_restores_and_computes_the_ideal(tiny):
    head = list(range(10, 40))
    turns = []
    for turn in range(4):
        for conv in range(4):  # four conversations in rotation: the device cannot hold them all
            user = (head if turn == 0 else []) + [60 + conv * 10 + turn] * (20 + turn)
            turns.append((conv, user, 6))
    replies, usage, loop = _play(tiny, turns, cache_on=True, num_blocks=60, concurrency=1, host_blocks=200)
    off, _, _ = _play(tiny, turns, cache_on=False, num_blocks=60, concurrency=1)
    assert replies == off
    stats = loop.cache.stats
    assert stats["parks"] > 0 and stats["restores"] > 0 and stats["dropped_blocks"] == 0
    computed = [p - c for p, c in usage]
    assert computed[0] == 50 and computed[1:4] == [20, 20, 20]  # later conversations reuse the head
    assert computed[4:] == [len(user) + 1 for _, user, _ in turns[4:]]  # nothing cached is recomputed


def test_long_randomized_workload_under_pressure_matches_cache_off_over_a_thousand_steps(tiny):
    turns = _random_turns(11, conversations=6, count=200)
    on, usage, loop = _play(tiny, turns, cache_on=True, num_blocks=90, host_blocks=40)
    off, _, _ = _play(tiny, turns, cache_on=False, num_blocks=90)
    assert on == off
    assert loop.num_steps > 1000 and loop.cache.stats["parks"] > 0 and loop.cache.stats["restores"] > 0
    assert sum(c for _, c in usage) > 0
