"""Conversation workloads through the engine loop on a tiny model: the cache never changes a token, and
computes exactly what is new (computed == ideal) when memory is ample; integrity after every step."""
import asyncio

import pytest

from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request
from tests.support.turn_workloads import HEAD_LEN, HEAD_SWAP, agent_turns, ideal_computed, random_turns


@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("qwen3", seed=4, n_ctx=1024)


def _play(tiny, turns, cache_on, num_blocks=400, slots=3, concurrency=3, host_blocks=0, layer_split=(), groups=1):
    """Run the turns [(conversation, new user tokens, reply length)] `concurrency` at a time.

    A conversation's prompt is its history + the new tokens; a user list starting with HEAD_SWAP replaces
    the history's first HEAD_LEN tokens by the rest of the list first (a prompt head that toggles).
    Returns (replies, per-request (prompt_len, cached_tokens, ideal computed tokens), the loop)."""
    model, tokenizer = tiny
    loop_holder = {}

    async def main():
        runner = ModelRunner(model, num_blocks, 4, host_blocks=host_blocks, layer_split=layer_split)
        loop = EngineLoop(runner, tokenizer, num_slots=slots, prefill_chunk=16, max_queue=64, prefix_cache=cache_on,
                          integrity_checks=True, batch_groups=groups)
        loop_holder["loop"] = loop
        loop.start()
        history, replies, usage, cached = {}, [], [], []
        for start in range(0, len(turns), concurrency):
            batch = turns[start : start + concurrency]
            streams = []
            for i, (conv, user, reply_len) in enumerate(batch):
                past = history.get(conv, [])
                if user and user[0] == HEAD_SWAP:
                    past, user = user[1 : HEAD_LEN + 1] + past[HEAD_LEN:], user[HEAD_LEN + 1 :]
                prompt = past + user
                params = SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True)
                streams.append((conv, prompt, loop.submit(Request(f"t{start + i}", prompt, params))))
            for conv, prompt, stream in streams:
                tokens, last = [], None
                async for delta in stream:
                    tokens += delta.token_ids
                    last = delta
                replies.append(tokens)
                usage.append((len(prompt), last.usage.cached_tokens, ideal_computed(prompt, cached)))
            for (conv, _, _), (_, prompt, _), tokens in zip(batch, streams, replies[-len(batch):]):
                history[conv] = prompt + tokens
                cached.append(prompt + tokens[:-1])  # the reply's last token is never computed
        await loop.shutdown(1)
        return replies, usage

    replies, usage = asyncio.run(main())
    return replies, usage, loop_holder["loop"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_on_and_off_produce_identical_replies(tiny, seed):
    turns = random_turns(seed)
    on, usage_on, loop = _play(tiny, turns, cache_on=True)
    off, usage_off, _ = _play(tiny, turns, cache_on=False)
    assert on == off
    assert sum(c for _, c, _ in usage_on) > 0 and all(c == 0 for _, c, _ in usage_off)
    loop.cache.check_integrity()


def test_alternating_conversations_compute_exactly_what_is_new(tiny):
    head = list(range(10, 40))  # shared system prompt
    turns = []
    for turn in range(4):
        for conv in (0, 1):
            user = (head if turn == 0 else []) + [50 + conv * 10 + turn] * (5 + turn)
            turns.append((conv, user, 6))
    _, usage, _ = _play(tiny, turns, cache_on=True, concurrency=1)
    computed = [p - c for p, c, _ in usage]
    # ideal: turn 1 of conv 0 reads everything; conv 1's first turn reuses the shared head (30 tokens);
    # every later turn reads its new user tokens + the previous reply's last token (never computed).
    assert computed[0] == 35 and computed[1] == 35 - 30 + 0
    assert computed[2:] == [len(user) + 1 for _, user, _ in turns[2:]]


def test_memory_pressure_evicts_but_never_changes_replies(tiny):
    turns = random_turns(7, conversations=5, count=24)
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
    computed = [p - c for p, c, _ in usage]
    assert computed[0] == 50 and computed[1:4] == [20, 20, 20]  # later conversations reuse the head
    assert computed[4:] == [len(user) + 1 for _, user, _ in turns[4:]]  # nothing cached is recomputed


@pytest.mark.parametrize("split, groups", [((), 1), ((1, 2), 3)])  # unpipelined; three stages, one slot a group
def test_long_randomized_workload_under_pressure_matches_cache_off_over_a_thousand_steps(tiny, split, groups):
    turns = random_turns(11, conversations=6, count=200)
    on, usage, loop = _play(tiny, turns, cache_on=True, num_blocks=90, host_blocks=40, layer_split=split,
                            groups=groups)
    off, _, _ = _play(tiny, turns, cache_on=False, num_blocks=90)
    assert on == off
    assert loop.num_steps > 1000 and loop.cache.stats["parks"] > 0 and loop.cache.stats["restores"] > 0
    assert sum(c for _, c, _ in usage) > 0


@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("split", [(), (1,), (1, 2)])
def test_pipelined_agent_workload_computes_exactly_the_ideal(tiny, split, groups):
    turns = agent_turns()
    replies, usage, loop = _play(tiny, turns, cache_on=True, layer_split=split, groups=groups)
    computed = [p - c for p, c, _ in usage]
    assert computed == [ideal for _, _, ideal in usage]
    assert sum(c for _, c, _ in usage) > sum(computed)  # most tokens came from the cache
    if split or groups > 1:
        assert replies == _play(tiny, turns, cache_on=True)[0]
