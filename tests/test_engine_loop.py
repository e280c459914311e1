"""The engine loop on a tiny random model: batching, chunked prefill, cancellation, queue limits, faults."""
import asyncio

import numpy as np
import pytest

from engine.generate import generate
from engine.sampling import SamplingParams
from engine.sequence import ModelRunner, Sequence
from scheduler import step as step_module
from scheduler.engine_loop import EngineLoop, QueueFullError
from scheduler.request import Request


@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("llama", seed=3, n_ctx=512)


def _loop(tiny, slots=4, chunk=8, max_queue=8, blocks=256):
    model, tokenizer = tiny
    return EngineLoop(ModelRunner(model, blocks, 4), tokenizer, num_slots=slots, prefill_chunk=chunk,
                      max_queue=max_queue)


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


def _greedy(max_tokens=12):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def _collect(stream):
    tokens, last = [], None
    async for delta in stream:
        tokens += delta.token_ids
        last = delta
    return tokens, last


def test_concurrent_requests_produce_the_tokens_they_produce_alone(tiny):
    model, tokenizer = tiny
    prompts = [_prompt(n, seed=n) for n in (3, 17, 30, 9)]
    alone = [generate(ModelRunner(model, 64, 4), tokenizer, p, _greedy()).token_ids for p in prompts]

    async def main():
        loop = _loop(tiny)
        loop.start()
        streams = [loop.submit(Request(f"r{i}", p, _greedy())) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*[_collect(s) for s in streams])
        await loop.shutdown(1)
        return results

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == alone
    assert all(last.finish_reason == "length" and last.usage.completion_tokens == 12 for _, last in results)


def test_abort_frees_the_slot_and_blocks_within_one_step(tiny):
    async def main():
        loop = _loop(tiny, slots=1)
        loop.start()
        stream = loop.submit(Request("victim", _prompt(5, 3), _greedy(10_000 // 100)))
        await stream.__anext__()
        steps_at_abort = loop.num_steps
        await stream.aclose()  # the client went away
        while loop.slots_snapshot()[0]["state"] != "idle":
            await asyncio.sleep(0.001)
        steps_taken = loop.num_steps - steps_at_abort
        loop.cache.check_integrity()
        free = loop.cache.num_free
        await loop.shutdown(1)
        return steps_taken, free

    steps_taken, free = asyncio.run(main())
    assert steps_taken <= 1
    assert free == 256


def test_queue_overflow_raises_queue_full(tiny):
    async def main():
        loop = _loop(tiny, slots=1, max_queue=2)  # not started: nothing leaves the queue
        loop.submit(Request("a", _prompt(3, 1), _greedy()))
        loop.submit(Request("b", _prompt(3, 2), _greedy()))
        with pytest.raises(QueueFullError):
            loop.submit(Request("c", _prompt(3, 3), _greedy()))

    asyncio.run(main())


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(tiny, monkeypatch):
    real = step_module.sample_step
    calls = {"n": 0}

    def flaky(work, logits):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(work, logits)

    monkeypatch.setattr("scheduler.engine_loop.sample_step", flaky)

    async def main():
        loop = _loop(tiny)
        loop.start()
        _, first = await _collect(loop.submit(Request("a", _prompt(3, 1), _greedy(3))))
        tokens, second = await _collect(loop.submit(Request("b", _prompt(3, 2), _greedy(3))))
        loop.cache.check_integrity()
        free = loop.cache.num_free
        await loop.shutdown(1)
        return first, second, tokens, free

    first, second, tokens, free = asyncio.run(main())
    assert first.finish_reason == "error" and "injected fault" in first.error
    assert second.finish_reason == "length" and len(tokens) == 3
    assert free == 256


def test_a_named_conversation_reaches_the_cache_and_is_listed_with_its_tokens(tiny):
    prompt = _prompt(10, seed=5)

    async def main():
        loop = _loop(tiny)
        loop.start()
        for i in range(2):
            request = Request(f"c{i}", prompt, _greedy(4))
            request.conversation_key = "session-7"
            await _collect(loop.submit(request))
        await loop.shutdown(1)
        return loop.cache_snapshot()["conversations"]

    listed = asyncio.run(main())
    entry = next(c for c in listed if c["key"] == "session-7")
    assert entry["turns"] == 2 and entry["named"] and entry["active"]
    assert entry["tokens"] == {"device": 13, "host": 0, "disk": 0}  # 10 prompt + 3 computed reply tokens


def test_under_the_engine_loop_the_cache_is_the_one_owner_of_block_ids(tiny):
    model, tokenizer = tiny
    runner = ModelRunner(model, 16, 4)
    assert runner.ensure_blocks(Sequence([1, 2, 3]), 3)  # standalone: the runner's own free list
    with pytest.raises(AssertionError, match="already in standalone use"):
        EngineLoop(runner, tokenizer, num_slots=1, prefill_chunk=8, max_queue=1)
    runner = ModelRunner(model, 16, 4)
    EngineLoop(runner, tokenizer, num_slots=1, prefill_chunk=8, max_queue=1)
    with pytest.raises(AssertionError, match="belong to the conversation cache"):
        runner.ensure_blocks(Sequence([1, 2, 3]), 3)
