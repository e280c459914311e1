"""Engine-loop sequences around a shrink of the elastic device pool, run on the numpy backend
(tests/test_device_pool.py) and on the CUDA backend's pool (tests/test_cuda_elastic_engine.py): each returns
what its next turn reused, so the same sequence with the cache off gives the tokens to compare."""
import asyncio

from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request


def seed_002_sequence(model, tokenizer, cache_on: bool, long_len=300, short_len=204, **runner_args):
    """A long conversation, a 204-token request, a shrink to 8 blocks and back, the long one's next turn:
    (its reply, its cached tokens, the first turn's tokens). runner_args go to the ModelRunner (a CUDA
    elastic pool's device_blocks: tests/test_cuda_elastic_engine.py runs this on the CUDA backend, with
    shorter prompts that still outgrow the 8 blocks, since the kernel emulator is slow)."""
    long_prompt = [(7 * i) % 200 + 20 for i in range(long_len)]
    short_prompt = [(11 * i) % 150 + 30 for i in range(short_len)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run():
        runner = ModelRunner(model, 64, 16, host_blocks=64, **runner_args)  # 64 reserved ids of 16 tokens
        loop = EngineLoop(runner, tokenizer, num_slots=1, prefill_chunk=64, max_queue=4, prefix_cache=cache_on,
                          integrity_checks=True, device_min_blocks=8 if cache_on else None)
        loop.start()

        async def serve(rid, prompt):
            tokens, last = [], None
            async for delta in loop.submit(Request(rid, prompt, params)):
                tokens += delta.token_ids
                last = delta
            return tokens, last.usage.cached_tokens

        reply, _ = await serve("long", long_prompt)
        await serve("short", short_prompt)
        if cache_on:
            assert loop.cache.num_blocks > 8  # the two requests grew the pool
            state = await loop.resize_device_pool(8)
            assert state["device_blocks"] == 8 and not state["stopped_by"]
            assert loop.cache.stats["dropped_blocks"] == 0 and loop.cache.stats["parks"] > 0
            await loop.resize_device_pool(64)  # the memory comes back (e.g. the expert cache returns it)
            assert loop.cache.num_blocks == 8  # it grows again only as requests need room
        second = long_prompt + reply + [5, 6, 7]
        reply2, cached = await serve("long-2", second)
        await loop.shutdown(1)
        return reply2, cached, len(long_prompt) + len(reply)

    return asyncio.run(run())


def moved_down_sequence(model, tokenizer, cache_on: bool, **runner_args):
    """Two identical prompts at once leave a run of free ids in the middle (the second copy is deduplicated
    at release); a third conversation above it is moved down into that run by a shrink to 10 blocks, and its
    next turn reuses it: (that reply, its cached tokens, blocks relocated, the first turn's tokens)."""
    twin = [(5 * i) % 190 + 20 for i in range(20)]  # 5 blocks of 4
    third = [(3 * i) % 170 + 25 for i in range(24)]  # 6 blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run():
        runner = ModelRunner(model, 32, 4, host_blocks=16, **runner_args)
        loop = EngineLoop(runner, tokenizer, num_slots=2, prefill_chunk=64, max_queue=4, prefix_cache=cache_on,
                          integrity_checks=True, device_min_blocks=8 if cache_on else None)
        loop.start()

        async def serve(rid, prompt):
            out = [d async for d in loop.submit(Request(rid, prompt, params))]
            return [t for d in out for t in d.token_ids], out[-1].usage.cached_tokens

        await asyncio.gather(serve("x", twin), serve("x2", twin))
        reply, _ = await serve("z", third)
        relocated = 0
        if cache_on:
            plan = loop.cache.plan_shrink(10)
            relocated = len(plan.relocations)
            assert (await loop.resize_device_pool(10))["device_blocks"] == 10
        reply2, cached = await serve("z2", third + reply + [9, 8, 7])
        await loop.shutdown(1)
        return reply2, cached, relocated, len(third) + len(reply)

    return asyncio.run(run())
