"""Prompts and a run of concurrent conversations through the engine loop over pipeline stages (a layer split)
and batch groups: shared by tests/test_pipeline.py and test_cpu_weights.py (the quantized split model)."""
import asyncio

import numpy as np

from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.engine_loop import EngineLoop
from scheduler.request import Request


def random_prompt(n, seed):
    """n token ids in 3..249, the same for the same seed."""
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


def run_conversations(tiny, split, groups, prompts, max_tokens=10, slots=4, wrap_pipeline=None):
    """Submit every prompt at once; returns (token lists, finish reasons, peak groups in flight, loop)."""
    model, tokenizer = tiny
    peak = {"groups": 0}

    async def main():
        loop = EngineLoop(ModelRunner(model, 256, 4, layer_split=split), tokenizer, num_slots=slots,
                          prefill_chunk=8, max_queue=16, integrity_checks=True, batch_groups=groups)
        real_run = loop.pipeline.run

        async def counting_run(group, work):
            peak["groups"] = max(peak["groups"], loop.pipeline.num_in_flight + 1)
            return await real_run(group, work)

        loop.pipeline.run = counting_run
        if wrap_pipeline:
            wrap_pipeline(loop.pipeline)
        loop.start()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        streams = [loop.submit(Request(f"c{i}", p, params)) for i, p in enumerate(prompts)]

        async def collect(stream):
            tokens, last = [], None
            async for delta in stream:
                tokens += delta.token_ids
                last = delta
            return tokens, last.finish_reason

        results = await asyncio.gather(*[collect(s) for s in streams])
        loop.cache.check_integrity()
        await loop.shutdown(1)
        return results, loop

    results, loop = asyncio.run(main())
    return [t for t, _ in results], [r for _, r in results], peak["groups"], loop
