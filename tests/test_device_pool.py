"""The elastic device pool: grows before it parks, shrinks by moving blocks down or parking them, never
drops to shrink, stops where it must and says why; seed 002's sequence keeps the long conversation."""
import asyncio
import sys

import numpy as np
import pytest

from engine.backends.reference.backend import NumpyKVPool
from engine.kv import KVLayout
from engine.sampling import SamplingParams
from engine.sequence import ModelRunner
from scheduler.cache.block_mover import RecordingMover
from scheduler.cache.checkpoint_store import CheckpointStore
from scheduler.cache.checkpoints import Checkpoints
from scheduler.engine_loop import EngineLoop
from scheduler.memory.admission import MemoryAdmission
from scheduler.cache.prefix_cache import PrefixCache
from scheduler.request import Request
from tests.support.cache_requests import serve_request
from tests.support.pool_sequences import moved_down_sequence, seed_002_sequence


def _elastic(min_blocks=4, reserved=12, segment=4, host_blocks=8, checkpoint_units=0):
    admission = MemoryAdmission(host_blocks, 64)
    admission.set_device_pool(min_blocks, reserved, segment)
    mover = RecordingMover()
    ckpt = Checkpoints(checkpoint_units, store=CheckpointStore((1, 1, 2))) if checkpoint_units else None
    return PrefixCache(min_blocks, 4, host_blocks=host_blocks, mover=mover, admission=admission,
                       checkpoints=ckpt), mover


def test_the_pool_grows_by_segments_before_anything_is_parked():
    cache, mover = _elastic()
    serve_request(cache, [1] * 16)  # 4 blocks: the whole initial pool
    alloc = serve_request(cache, [2] * 16)
    assert cache.num_blocks == 8 and alloc.block_table == [4, 5, 6, 7]
    assert cache.stats["parks"] == 0 and ("resize_device", 8) in mover.moves


def test_at_its_ceiling_the_pool_parks_as_a_fixed_one_does():
    cache, _ = _elastic(reserved=8)
    for first in (1, 2, 3):
        serve_request(cache, [first] * 16)
    assert cache.num_blocks == 8 and cache.stats["parks"] == 4 and cache.stats["dropped_blocks"] == 0


def test_a_shrink_moves_cached_blocks_down_into_free_ids():
    cache, mover = _elastic(reserved=8)
    serve_request(cache, [1] * 8)  # blocks 0, 1
    serve_request(cache, [2] * 16)  # needs 4 more than the 2 free: grows, takes 2, 3, 4, 5
    cache.release([9] * 4, 4, cache.allocate(cache.match([9] * 4, 3), 4))  # a one-block prompt on 6
    cache.check_integrity()
    tail = [b for b in cache.tiers.blocks("device").values() if b.device_id >= 4]
    head_free = [b for b in range(4) if cache.tiers.is_free(b)]
    plan = cache.plan_shrink(4)
    assert plan.shrink_to == 4 and not plan.stopped_by
    assert cache.admission.grant(plan)
    mover.moves.clear()
    cache.apply(plan)
    cache.check_integrity()
    assert cache.num_blocks == 4 and cache.stats["dropped_blocks"] == 0
    copies = [m for m in mover.moves if m[0] == "copy"]
    parks = [m for m in mover.moves if m[0] == "park"]
    assert len(copies) == min(len(tail), len(head_free)) and len(copies) + len(parks) == len(tail)
    assert mover.moves[-1] == ("resize_device", 4)
    assert cache.match([2] * 16).num_tokens == 16  # the conversation is whole: on the device or parked


def test_a_shrink_never_drops_and_stops_without_host_room():
    cache, _ = _elastic(reserved=8, host_blocks=1)
    serve_request(cache, [1] * 16)
    serve_request(cache, [2] * 16)  # 8 blocks cached, none free
    plan = cache.plan_shrink(4)
    assert plan.shrink_to == 7 and "host tier" in plan.stopped_by  # one park fits, then it stops
    cache.apply(plan)
    cache.check_integrity()
    assert cache.num_blocks == 7 and cache.stats["dropped_blocks"] == 0 and cache.num_cached == 8


def test_a_shrink_stops_at_a_block_a_running_request_holds():
    cache, _ = _elastic(reserved=8)
    serve_request(cache, [1] * 16)
    held = cache.allocate(cache.match([2] * 16, 15), 16)  # running: ids 4-7, owned
    plan = cache.plan_shrink(4)
    assert plan.shrink_to == 8 and "running request" in plan.stopped_by
    cache.release([2] * 16, 16, held)
    assert cache.plan_shrink(4).shrink_to == 4


def test_a_shrink_keeps_free_ids_for_the_device_checkpoints_and_relocated_blocks_keep_theirs():
    cache, _ = _elastic(reserved=8, checkpoint_units=1)
    held = cache.allocate(cache.match([5] * 8, 7), 8)  # ids 0, 1, held
    serve_request(cache, [2] * 8, checkpoint=True)  # 2 blocks + 1 checkpoint slot > 2 free: grows to 8; ids 2, 3
    cache.release([5] * 8, 0, held)  # computed nothing: ids 0, 1 free again
    tail = cache.tiers.blocks("device")[3]
    assert cache.num_blocks == 8 and tail.checkpoints == {4} and cache.tiers.num_free_ids("device") == 6
    plan = cache.plan_shrink(2)
    # 7..4 free, 3 moves to 0; moving 2 to 1 as well would leave no free id for the checkpoint's slot
    assert plan.shrink_to == 3 and plan.relocations == [(tail, 0)] and not plan.parks
    assert "checkpoints" in plan.stopped_by
    assert cache.admission.grant(plan)
    cache.apply(plan)
    cache.check_integrity()
    assert cache.num_blocks == 3 and tail.device_id == 0 and tail.checkpoints == {4}
    assert set(cache.ckpt.store.tiers["device"]) == {(tail.digest, 4)}
    assert cache.match([2] * 8 + [7], 8).num_tokens == 8  # the state after the prompt is still there


def test_a_shrink_parks_a_checkpointed_block_with_its_checkpoints():
    cache, mover = _elastic(reserved=8, checkpoint_units=1)
    serve_request(cache, [1] * 8)  # ids 0, 1
    serve_request(cache, [2] * 8, checkpoint=True)  # grows to 8: ids 2, 3, the checkpoint on 3
    tail, head = cache.tiers.blocks("device")[3], cache.tiers.blocks("device")[2]
    plan = cache.plan_shrink(2)
    assert plan.shrink_to == 2 and plan.parks == [tail, head] and not plan.relocations and not plan.stopped_by
    assert cache.admission.grant(plan)
    cache.apply(plan)
    cache.check_integrity()
    assert tail.on_host and tail.checkpoints == {4} and set(cache.ckpt.store.tiers["host"]) == {(tail.digest, 4)}
    assert cache.ckpt.units_on("device") == 0 and cache.stats["dropped_blocks"] == 0
    assert cache.tiers.free_slots("host") == 8 - 3  # the checkpoint's slot, too


def test_a_parked_checkpoint_needs_a_host_slot_of_its_own():
    cache, _ = _elastic(reserved=8, host_blocks=2, checkpoint_units=1)
    serve_request(cache, [1] * 8)
    serve_request(cache, [2] * 8, checkpoint=True)  # ids 2, 3, the checkpoint on 3
    plan = cache.plan_shrink(2)
    assert plan.shrink_to == 3 and plan.parks == [cache.tiers.blocks("device")[3]] and "host tier" in plan.stopped_by


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise release is Linux-only")
def test_a_shrunk_numpy_pool_gives_its_pages_back():
    layout = KVLayout(num_blocks=256, block_size=16, n_layers=2, n_kv_heads=2, head_dim=128)  # 16 MiB in all
    pool = NumpyKVPool(layout)
    pool.k[:] = 1.0
    pool.v[:] = 1.0
    released = pool.release_from(128)
    assert released >= 0.99 * pool.nbytes / 2
    assert pool.k[:, :, : 128 * 16].all() and pool.v[:, :, : 128 * 16].all()  # the kept half is intact
    assert np.count_nonzero(pool.k[:, :, 128 * 16:]) < 0.01 * pool.k[:, :, 128 * 16:].size  # pages went back


def test_seed_002_a_short_request_and_a_shrink_keep_the_long_conversation(load_tiny):
    """A long conversation, a 204-token request, a shrink: the long one's next turn computes only its new
    tokens (seed 002 lost a 128K conversation this way 20.9% of the time), with the same tokens as no cache."""
    model, tokenizer = load_tiny("llama", seed=3, n_ctx=512)
    reply2, cached, first_turn = seed_002_sequence(model, tokenizer, True)
    assert cached == first_turn - 1  # every computed token of turn one came back
    assert reply2 == seed_002_sequence(model, tokenizer, False)[0]


@pytest.mark.slow
def test_the_server_grows_its_pool_and_shrinks_it_on_request(smollm2):
    import httpx

    from tests.support.server_harness import running_server

    asks = [{"model": "smollm2", "messages": [{"role": "user", "content": f"Name three {thing}. " * 12}],
             "max_tokens": 4, "temperature": 0} for thing in ("rivers", "mountains")]
    # ctx 128: the pool starts at one slot's 8 blocks (the flags' floor) and may grow to 100 MiB (142 blocks)
    with running_server(smollm2, batch=1, ctx_size=128, kv_cache_mib="0:100", kv_type="f32") as (url, state):
        before = httpx.get(url + "/cache").json()["device_total"]
        for ask in asks:  # each ~90 tokens: the second grows the pool instead of parking the first
            assert httpx.post(url + "/v1/chat/completions", json=ask, timeout=120).status_code == 200
        grown = httpx.get(url + "/cache").json()
        assert before == 8 and grown["device_total"] > before and grown["device_grows"] >= 1
        assert grown["parks"] == 0
        shrunk = httpx.post(url + "/cache/device-pool", json={"max_blocks": 8}, timeout=30).json()
        assert shrunk["device_blocks"] == 8 and not shrunk["stopped_by"]
        after = httpx.get(url + "/cache").json()
        assert after["dropped_blocks"] == 0 and after["device_total"] == 8 and after["parks"] > 0
        block, mib = state.engine.runner.layout.bytes_per_block, 2**20
        device, host = after["tiers"]["device"], after["tiers"]["host"]
        assert (device["budget_mib"], device["committed_mib"]) == (142 * block // mib, 8 * block // mib)
        assert device["used_mib"] <= device["committed_mib"] and host["used_mib"] == after["host_cached"] * block // mib
        assert host["committed_mib"] >= host["used_mib"] and host["budget_mib"] >= host["committed_mib"]
        for ask in asks:  # both conversations are whole: restored from host RAM, nothing recomputed
            usage = httpx.post(url + "/v1/chat/completions", json=ask, timeout=120).json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        bad = httpx.post(url + "/cache/device-pool", json={"max_mib": 1, "max_blocks": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_mib"


@pytest.mark.slow
def test_a_fixed_pool_refuses_to_be_resized_and_names_the_flag(server):
    import httpx

    url, _ = server  # the API tests' shared server: a fixed pool (--kv-cache-mib without MIN:MAX)
    fixed = httpx.post(url + "/cache/device-pool", json={"max_blocks": 4})
    assert fixed.status_code == 400 and "--kv-cache-mib MIN:MAX" in fixed.json()["error"]["message"]


def test_blocks_moved_down_by_a_shrink_keep_their_bytes(load_tiny):
    """A third conversation moved down into free ids by a shrink: its next turn reuses it and produces the
    tokens of a server without a cache."""
    model, tokenizer = load_tiny("llama", seed=3, n_ctx=512)
    reply2, cached, relocated, first_turn = moved_down_sequence(model, tokenizer, True)
    assert relocated >= 4 and cached == first_turn - 1
    assert reply2 == moved_down_sequence(model, tokenizer, False)[0]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigusr1_shrinks_an_elastic_pool_to_its_minimum_and_sigusr2_gives_its_range_back(load_tiny):
    import os
    import signal

    from api.serve import _install_pool_signals

    model, tokenizer = load_tiny("llama", seed=3, n_ctx=512)

    async def main():
        loop = EngineLoop(ModelRunner(model, 32, 4, host_blocks=32), tokenizer, num_slots=1, prefill_chunk=64,
                          max_queue=4, integrity_checks=True, device_min_blocks=8)
        loop.start()
        _install_pool_signals(loop)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        [d async for d in loop.submit(Request("r", [(3 * i) % 170 + 25 for i in range(60)], params))]
        grown = loop.cache.num_blocks
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if loop.cache.num_blocks == 8:
                break
        shrunk, ceiling = loop.cache.num_blocks, loop.cache.admission.device_ceiling_blocks
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.sleep(0.05)
        await loop.shutdown(1)
        return grown, shrunk, ceiling, loop.cache.admission.device_ceiling_blocks, loop.cache.stats

    grown, shrunk, ceiling, restored, stats = asyncio.run(main())
    assert grown > 8 and (shrunk, ceiling) == (8, 8) and restored == 32
    assert stats["dropped_blocks"] == 0 and stats["parks"] > 0
