"""Refused grants at each point (park, restore, spill, grow, device grow) on the engine's real path: the
memory admission's coroutine serving the requests' own plans between steps and an operator's resizes from
its queue, with a small device pool, an on-demand host tier that must grow and spill, and a disk tier.
Replies equal the cache-off run's, integrity holds after every step, no block is dropped, no preempted
request recomputes, and the refused point was refused many times."""
import asyncio

import numpy as np
import pytest

from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.cache.disk_tier import DiskTier
from scheduler.engine_loop import EngineLoop
from scheduler.memory.admission import MemoryAdmission
from scheduler.request import Request
from tests.support.turn_workloads import random_turns

RESERVED, MIN_BLOCKS, HOST_BLOCKS = 70, 40, 24


@pytest.fixture(scope="module")
def tiny(load_tiny):
    return load_tiny("qwen3", seed=4, n_ctx=1024)


def _refuse_point(admission, point, seed=7, rate=0.5):
    """Refuse the first plan that needs `point` and then half of them; count them."""
    rng, grant = np.random.default_rng(seed), admission.grant
    admission.point_refusals, admission.points_seen = 0, {}

    def flaky(plan):
        for name in plan.points:
            admission.points_seen[name] = admission.points_seen.get(name, 0) + 1
        if point in plan.points and (admission.points_seen[point] == 1 or rng.random() < rate):
            admission.refusals += 1
            admission.point_refusals += 1
            return False
        return grant(plan)
    admission.grant = flaky


def _play(tiny, tmp_path, turns, cache_on, point=None):
    model, tokenizer = tiny

    async def main():
        runner = ModelRunner(model, RESERVED, 4, host_blocks=0)
        admission = MemoryAdmission(HOST_BLOCKS if cache_on else 0, runner.layout.bytes_per_block,
                                    host_committed_blocks=0, segment_blocks=4)
        disk = DiskTier.for_layout(tmp_path, "faults", "numpy", runner.layout, 400 * runner.layout.bytes_per_block) \
            if cache_on else None
        loop = EngineLoop(runner, tokenizer, num_slots=3, prefill_chunk=16, max_queue=64, prefix_cache=cache_on,
                          integrity_checks=True, disk=disk, admission=admission,
                          device_min_blocks=MIN_BLOCKS if cache_on else None)
        if point:
            _refuse_point(admission, point)
        loop.start()
        shaker = asyncio.create_task(_shake(loop)) if cache_on else None
        history, replies = {}, []
        for start in range(0, len(turns), 3):
            streams = []
            for i, (conv, user, reply_len) in enumerate(turns[start : start + 3]):
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


async def _shake(loop, seed=3):
    """An operator's resizes, queued to the admission coroutine while steps run."""
    rng = np.random.default_rng(seed)
    while True:
        await asyncio.sleep(float(rng.uniform(0.0, 0.03)))
        await loop.resize_device_pool(int(rng.integers(MIN_BLOCKS, RESERVED + 1)))


@pytest.fixture(scope="module")
def workload():
    return [(c, u, r * 4) for c, u, r in random_turns(9, conversations=8, count=36)]


@pytest.fixture(scope="module")
def cache_off(tiny, tmp_path_factory, workload):
    return _play(tiny, tmp_path_factory.mktemp("off"), workload, cache_on=False)[0]


@pytest.mark.parametrize("point", ["park", "restore", "spill", "grow", "device_grow"])
def test_a_refused_grant_at_each_point_loses_no_conversation(tiny, tmp_path, workload, cache_off, point):
    on, loop = _play(tiny, tmp_path, workload, cache_on=True, point=point)
    stats = loop.cache.stats
    assert on == cache_off
    assert loop.cache.admission.point_refusals > 0, loop.cache.admission.points_seen
    assert stats["refused_plans"] >= loop.cache.admission.point_refusals
    assert stats["dropped_blocks"] == 0 and loop.recomputed_tokens == 0, stats
    assert loop.memory.num_served > 0  # the operator's resizes went through the admission's queue
    assert stats["parks"] > 0 and stats["restores"] > 0 and stats["spills"] > 0, stats


def test_a_step_the_table_already_holds_asks_the_admission_for_nothing(tiny):
    """The decode step's fast path: no plan, no grant, no queued request served ahead (no extra loop tick);
    a step past the table's end goes through the admission."""
    model, tokenizer = tiny

    async def main():
        loop = EngineLoop(ModelRunner(model, 16, 4), tokenizer, num_slots=1, prefill_chunk=16, max_queue=4)
        loop.memory.start()
        loop.submit(Request("r", list(range(3, 13)), SamplingParams(temperature=0, max_tokens=4)))
        loop.admit()  # 10 tokens: a table of 3 blocks (12 tokens)
        request, asked = loop.table.slots[0], []
        grant = loop.memory.grant
        loop.memory.grant = lambda planner: asked.append(1) or grant(planner)
        queued = asyncio.ensure_future(loop.memory.request(lambda: "operator", "operator"))
        await asyncio.sleep(0)
        assert loop.requests.reserve(request, 12) and asked == [] and loop.memory.num_queued == 1
        assert loop.requests.reserve(request, 13) and asked == [1] and loop.memory.num_queued == 0
        assert len(request.seq.block_table) == 4 and await queued == "operator"
        await loop.memory.close()

    asyncio.run(main())
