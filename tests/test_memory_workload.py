"""Blocks as tokens arrive, under pressure: requests grow their tables step by step, cached blocks are
parked in value order, running requests are preempted (newest first) and resume by restore, and some
grants are refused outright. Replies equal the cache-off run's, integrity holds after every step, and no
preempted request recomputes a token."""
import asyncio

import numpy as np
import pytest

from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request
from tests.support.turn_workloads import random_turns


@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("qwen3", seed=4, n_ctx=1024)


def _refuse_some(loop, seed, rate):
    """Refuse a share of the plans that move something (never a release), as a failing budget would."""
    rng, admission = np.random.default_rng(seed), loop.cache.admission
    grant = admission.grant

    def flaky(plan):
        if plan.points and rng.random() < rate:
            admission.refusals += 1
            return False
        return grant(plan)
    admission.grant = flaky


def _run_workload(tiny, turns, cache_on, num_blocks, host_blocks, refuse_rate=0.0, slots=4, elastic_min=None):
    """(replies, loop): `turns` (conversation, user ids, reply length) through a fresh engine loop, `slots` at
    a time, each prompt the conversation's history so far plus the user's ids."""
    model, tokenizer = tiny

    async def main():
        runner = ModelRunner(model, num_blocks, 4, host_blocks=host_blocks)
        loop = EngineLoop(runner, tokenizer, num_slots=slots, prefill_chunk=16, max_queue=64,
                          prefix_cache=cache_on, integrity_checks=True, device_min_blocks=elastic_min)
        if refuse_rate:
            _refuse_some(loop, 5, refuse_rate)
        loop.start()
        shaker = asyncio.create_task(_shake_pool(loop, elastic_min, num_blocks)) if elastic_min else None
        history, replies = {}, []
        for start in range(0, len(turns), slots):
            streams = []
            for i, (conv, user, reply_len) in enumerate(turns[start : start + slots]):
                prompt = history.get(conv, []) + user
                params = SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True)
                streams.append((conv, prompt, loop.submit(Request(f"r{start + i}", prompt, params))))
            for conv, prompt, stream in streams:
                tokens = [t async for d in stream for t in d.token_ids]
                replies.append(tokens)
                history[conv] = prompt + tokens
        if shaker is not None:
            shaker.cancel()
        await loop.shutdown(1)
        return replies, loop

    return asyncio.run(main())


async def _shake_pool(loop, min_blocks, reserved, seed=11):
    """An operator (or the expert cache) moving the elastic pool's ceiling at random, mid-step included."""
    rng = np.random.default_rng(seed)
    while True:
        await asyncio.sleep(float(rng.uniform(0.0, 0.02)))
        await loop.resize_device_pool(int(rng.integers(min_blocks, reserved + 1)))
        loop.shakes = getattr(loop, "shakes", 0) + 1


def _long_replies(seed):
    return [(c, u, r * 6) for c, u, r in random_turns(seed, conversations=10, count=80)]


def test_preemption_under_a_small_pool_keeps_every_token_and_recomputes_nothing(tiny):
    turns = _long_replies(3)
    on, loop = _run_workload(tiny, turns, cache_on=True, num_blocks=110, host_blocks=4000, refuse_rate=0.05)
    off, _ = _run_workload(tiny, turns, cache_on=False, num_blocks=110, host_blocks=0)  # preempted: recomputes
    assert on == off and sum(map(bool, on)) > 0.9 * len(on)  # a few grew past the pool: refused alike
    stats = (loop.num_steps, loop.num_preemptions, loop.cache.admission.refusals, loop.cache.stats)
    assert loop.num_steps > 1000 and loop.num_preemptions > 0 and loop.cache.admission.refusals > 0, stats
    assert loop.recomputed_tokens == 0 and loop.cache.stats["dropped_blocks"] == 0
    assert loop.cache.stats["parks"] > 0 and loop.cache.stats["restores"] > 0


def test_an_elastic_pool_that_grows_and_shrinks_under_load_keeps_every_token(tiny):
    turns = _long_replies(5)
    on, loop = _run_workload(tiny, turns, cache_on=True, num_blocks=160, host_blocks=4000, refuse_rate=0.03,
                      elastic_min=60)
    off, _ = _run_workload(tiny, turns, cache_on=False, num_blocks=160, host_blocks=0)
    stats = loop.cache.stats
    assert on == off and loop.num_steps > 500, (loop.num_steps, stats)
    assert stats["device_grows"] > 0 and stats["device_shrinks"] > 0 and loop.shakes > 10, stats
    assert loop.recomputed_tokens == 0 and stats["dropped_blocks"] == 0  # a shrink parks, never drops


def test_batch_larger_than_worst_case_reservations_runs_every_request_at_once(tiny):
    # 4 slots, a pool of 40 blocks = 160 tokens; each request's worst case (30 + 60) is 23 blocks, so
    # worst-case reservations would run one at a time. Growing tables run all four together.
    prompts = [[10 + i] * 30 for i in range(4)]
    model, tokenizer = tiny

    async def main():
        loop = EngineLoop(ModelRunner(model, 40, 4, host_blocks=200), tokenizer, num_slots=4, prefill_chunk=16,
                          max_queue=8, integrity_checks=True)
        loop.start()
        streams = [loop.submit(Request(f"b{i}", p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)))
                   for i, p in enumerate(prompts)]
        most = 0

        async def watch():
            nonlocal most
            while True:
                most = max(most, sum(r is not None for r in loop.table.slots))
                await asyncio.sleep(0)
        watcher = asyncio.create_task(watch())
        outs = [[t async for d in s for t in d.token_ids] for s in streams]
        watcher.cancel()
        running = most
        await loop.shutdown(1)
        return running, outs, loop

    running, outs, loop = asyncio.run(main())
    assert running == 4 and all(len(o) == 60 for o in outs)
    assert loop.recomputed_tokens == 0 and loop.num_preemptions > 0  # 4 x 90 tokens outgrow the pool
