"""The expert cache's device budget under the memory admission (engine/backends/cuda/expert_cache/budget.py), on
the emulated driver with the real kernels: an engine with an elastic CUDA KV pool and the expert cache's slots
mapped beside it in the same budget. The KV pool takes room back from the expert cache instead of parking a
conversation, and grows into the bytes given back; the expert cache grows back into spare budget; a refused
grow changes nothing; tokens equal numpy's throughout, every slot holds its expert's bytes.

Sizes (tiny qwen3moe, 2 MoE layers x 8 experts, Q8_0 experts, f32 K/V): a block is 8 KiB, a slot 6.75 KiB,
mapped in 4 KiB pages. Budget 22 blocks: the pool starts at 8, `auto` maps all 16 slots (27 pages) beside it.
"""
import asyncio

import numpy as np
import pytest

from engine.backends.cuda.expert_cache.cache import ROLES
from engine.backends.reference.backend import NumpyBackend
from scheduler.request import Request, SamplingParams
from tests.support.cuda_backend_checks import PAGE, SEG, greedy_and_logits
from tests.support.tiny_moe_gguf import write_tiny_moe_gguf

RESERVED, MIN_BLOCKS = 22, 8
PROMPTS = [[(7 * i) % 90 + 20 for i in range(100)], [(11 * i) % 80 + 30 for i in range(100)]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def moe(tmp_path, monkeypatch, emulator_dir):  # noqa: F811
    """(CUDA model with an `auto` expert cache on the emulated driver, numpy model, tokenizer)."""
    from engine.backends.cuda.backend import CudaBackend
    from engine.backends.cuda.expert_cache.setup import configure_expert_cache
    from engine.gguf_file import GGUFFile
    from engine.model import load_model
    from engine.tokenizer import Tokenizer
    from tests.support import fake_cuda_emulated

    write_tiny_moe_gguf(tmp_path / "m.gguf", "qwen3moe", seed=2, n_layer=2, router_scale=0.3, expert_quant="Q8_0",
                        n_ctx=512)
    driver = fake_cuda_emulated.install(monkeypatch, emulator_dir)
    driver.vmm_granularity = PAGE
    backend = CudaBackend(graphs=False)
    backend.kv_segment_blocks = SEG
    configure_expert_cache(backend, "auto")
    tokenizer = Tokenizer.from_gguf_fields(GGUFFile(tmp_path / "m.gguf").fields)
    yield load_model(tmp_path / "m.gguf", backend)[0], load_model(tmp_path / "m.gguf", NumpyBackend())[0], tokenizer
    backend.close()


def _engine(model, tokenizer, connect: bool, layer_split=(), groups: int = 1):
    from engine.backends.cuda.expert_cache.budget import HOLDER_NAME, connect_expert_budget
    from engine.sequence import ModelRunner
    from scheduler.engine_loop import EngineLoop

    runner = ModelRunner(model, RESERVED, 16, host_blocks=64, device_blocks=MIN_BLOCKS, layer_split=layer_split)
    engine = EngineLoop(runner, tokenizer, num_slots=groups, prefill_chunk=64, max_queue=4, integrity_checks=True,
                        device_min_blocks=MIN_BLOCKS, batch_groups=groups)
    budget = connect_expert_budget(model.backend.expert_cache, engine.memory.register_budget(HOLDER_NAME), top_k=2,
                                   is_idle=lambda: not engine.in_flight) if connect else None
    return engine, budget


async def _complete(engine, rid, prompt):
    """One request through the running engine: (its generated ids, the cached tokens its usage reported)."""
    tokens, last = [], None
    async for delta in engine.submit(Request(rid, prompt, PARAMS)):
        tokens += delta.token_ids
        last = delta
    return tokens, last.usage.cached_tokens


def check_slots(backend, cache):
    """Slot bookkeeping whole; each resident's table entries point into its slot, which holds its arena bytes;
    every other entry is 0 (a kernel reading a shrunk-away slot would fault on the emulator's unmapped pages)."""
    cache.slots.check_integrity()
    resident = {key: cache.slots.slot_of(*key) for key in cache.slots.resident()}
    for layer in cache.layers:
        for expert in range(layer.n_experts):
            slot = resident.get((layer.index, expert))
            if slot is None:
                assert not layer.table[:, expert].any(), (layer.index, expert)
                continue
            base = cache.memory.address(slot)
            assert [int(a) for a in layer.table[:, expert]] == [base + layer.slot_offsets[r] for r in ROLES]
            for i, role in enumerate(ROLES):
                offset, nbytes = layer.parts[role]
                got = np.empty(nbytes, np.uint8)
                backend.device.dtoh(got.ctypes.data, int(layer.table[i, expert]), nbytes, backend.stream)
                backend.synchronize_stream(backend.stream)
                assert (got == layer.host.array[offset + expert * nbytes: offset + (expert + 1) * nbytes]).all()


def _budget_holds(engine, budget):
    admission = engine.cache.admission
    assert engine.cache.num_blocks * admission.block_bytes + budget.holder.held_bytes <= admission.device_budget_bytes
    assert budget.holder.held_bytes >= budget.memory.bytes_for(budget.cache.num_slots)
    assert budget.memory.vmm.mapped_bytes == budget.memory.bytes_for(budget.cache.num_slots)


def _sequence(model, tokenizer, connect: bool, after=None):
    """Two conversations that do not fit the starting pool together, then the first one's next turn; `after`
    (engine, budget) runs on the loop before the engine shuts down. Returns (replies, cached tokens, engine)."""

    async def run():
        engine, budget = _engine(model, tokenizer, connect)
        engine.start()
        first, _ = await _complete(engine, "a", PROMPTS[0])
        second, _ = await _complete(engine, "b", PROMPTS[1])
        third, cached = await _complete(engine, "a2", PROMPTS[0] + first + [5, 6, 7])
        extra = await after(engine, budget) if after else None
        await engine.shutdown(1)
        return [first, second, third], cached, engine, extra

    return asyncio.run(run())


def test_the_kv_pool_takes_room_from_the_expert_cache_instead_of_parking_and_tokens_equal_numpy(moe):
    model, numpy_model, tokenizer = moe
    cache = model.backend.expert_cache
    checked, resize = {"after_resize": 0, "failed": []}, cache._resize

    def checked_resize(wanted):  # every resize, checked at once (streams idle, under the cache's lease)
        resize(wanted)
        try:
            check_slots(model.backend, cache)
        except AssertionError as failure:  # recorded: raised inside a step it would stall the engine loop
            checked["failed"].append(failure)
        checked["after_resize"] += 1

    cache._resize = checked_resize

    async def after(engine, budget):
        _budget_holds(engine, budget)
        check_slots(model.backend, cache)
        checked.update(held=budget.holder.held_bytes, reclaims=budget.num_reclaims)

    replies, cached, engine, _ = _sequence(model, tokenizer, True, after)
    stats = engine.cache.stats
    assert stats["parks"] == 0 and stats["dropped_blocks"] == 0  # the pool never parked: it took expert slots
    assert cached == len(PROMPTS[0]) + PARAMS.max_tokens - 1  # the first conversation came back whole
    assert engine.cache.num_blocks > RESERVED - 16 * 6912 // 8192  # grown past what it had beside all 16 slots
    assert 2 <= cache.num_slots < 16 and cache.num_shrinks >= 1 and checked["reclaims"] >= 1
    assert engine.memory.num_waits_for_holders >= 1 and checked["after_resize"] == 1 + cache.num_shrinks
    assert checked["failed"] == []
    assert cache.stats()["expert_cache_held_bytes"] == checked["held"] < 16 * 6912
    from scheduler.metrics import Metrics

    metrics = Metrics()
    metrics.watch_expert_cache(cache)
    text = metrics.render().decode()
    assert f'strata_expert_cache_resizes_total{{direction="shrink"}} {float(cache.num_shrinks)}' in text
    assert f'strata_expert_cache_bytes{{where="device_held"}} {float(checked["held"])}' in text
    assert "strata_expert_cache_hit_rate" in text  # the hit-rate figures keep working beside the budget's
    reference, ref_cached, ref_engine, _ = _sequence(numpy_model, tokenizer, False)
    assert replies == reference and cached == ref_cached


def test_without_the_expert_cache_in_the_budget_the_same_sequence_parks(moe):
    """The same sequence with the pool's budget all its own but its ceiling where the slots left it: the
    conversation is parked (what room_from_holders avoids above)."""
    model, _, tokenizer = moe

    async def run():
        engine, _ = _engine(model, tokenizer, False)
        engine.cache.admission.set_device_ceiling(RESERVED - 14)  # what all 16 slots leave the pool
        engine.start()
        await _complete(engine, "a", PROMPTS[0])
        await _complete(engine, "b", PROMPTS[1])
        await engine.shutdown(1)
        return engine.cache.stats["parks"]

    assert asyncio.run(run()) > 0


def test_a_refused_grow_back_changes_nothing_and_a_granted_one_maps_the_slots_back(moe, monkeypatch):
    from engine.backends.cuda.expert_cache import budget as cuda_expert_cache_budget

    model, numpy_model, tokenizer = moe
    cache = model.backend.expert_cache

    async def after(engine, budget):
        budget._seen = (0, 0)  # the growth check's window: since start (the sequence missed plenty)
        wanted_after_reclaim = budget.wants_to_grow()  # reclaimed moments ago: the cooldown holds it back
        monkeypatch.setattr(cuda_expert_cache_budget, "RECLAIM_COOLDOWN_S", 0.0)
        budget._seen = (0, 0)
        assert not wanted_after_reclaim and budget.wants_to_grow()
        before = (cache.num_slots, budget.holder.held_bytes, engine.cache.num_blocks, engine.cache.stats["parks"],
                  cache.slots.resident())
        refused = await budget.grow_back()  # the pool's ids all hold cached blocks: it would have to park
        after_refused = (cache.num_slots, budget.holder.held_bytes, engine.cache.num_blocks,
                         engine.cache.stats["parks"], cache.slots.resident())
        state = await engine.resize_device_pool(MIN_BLOCKS)  # the operator shrinks the pool (parks, no drops)
        granted = await budget.grow_back()
        await asyncio.sleep(0.01)  # the resize's give-back note reaches the loop
        _budget_holds(engine, budget)
        check_slots(model.backend, cache)
        return before, refused, after_refused, state, granted, cache.num_slots, budget.holder.held_bytes

    replies, _, engine, extra = _sequence(model, tokenizer, True, after)
    before, refused, after_refused, state, granted, slots, held = extra
    assert not refused and after_refused == before
    assert state["device_blocks"] == MIN_BLOCKS and engine.cache.stats["dropped_blocks"] == 0
    assert granted and slots == 16 and held == 27 * PAGE and cache.num_grows >= 1
    assert replies == _sequence(numpy_model, tokenizer, False)[0]


def test_a_shrink_evicts_the_least_recently_used_and_moves_the_rest_down_with_their_bytes(moe):
    """Slots in a mapped range (the elastic pool's case): after a shrink from 16 to 5 between steps, the five
    most recently used experts sit in slots 0..4 with their bytes, the pages above are unmapped, and the next
    steps' tokens equal numpy's."""
    from engine.backends.cuda.expert_cache.memory import VmmSlotMemory

    model, numpy_model, _ = moe
    cache = model.backend.expert_cache
    cache.create_slots(16, VmmSlotMemory(cache.device, cache.slot_bytes, cache.total_experts))
    greedy_and_logits(model, range(3, 15), steps=3)
    recent = cache.slots.resident()[-5:]
    slots_before = {key: cache.slots.slot_of(*key) for key in recent}
    assert any(slot >= 5 for slot in slots_before.values())  # some must move
    cache.request_resize(5)
    cache.at_step_start()
    assert cache.slots.resident() == recent and sorted(cache.slots.slot_of(*k) for k in recent) == [0, 1, 2, 3, 4]
    assert cache.memory.vmm.mapped_bytes == cache.memory.bytes_for(5) < cache.memory.bytes_for(16)
    assert cache.num_shrinks == 1 and cache.moved_by_shrinks == sum(s >= 5 for s in slots_before.values())
    check_slots(model.backend, cache)
    prompt = range(3, 15)
    assert greedy_and_logits(model, prompt, steps=6)[0] == greedy_and_logits(numpy_model, prompt, steps=6)[0]
    check_slots(model.backend, cache)


def test_on_two_stages_and_two_groups_the_pool_takes_slots_while_the_other_group_steps(moe):
    """Both conversations at once through 2 pipeline stages x 2 batch groups: a group's grant waits while the
    other group's step is in flight, the shrink applies at a stage's step start on its worker thread, its
    give-back reaches the loop; nothing parked or dropped, every slot checked after each resize, numpy's tokens."""
    import threading

    model, numpy_model, tokenizer = moe
    cache = model.backend.expert_cache
    seen, resize = {"threads": set(), "failed": []}, cache._resize

    def checked_resize(wanted):
        resize(wanted)
        seen["threads"].add(threading.current_thread().name)
        try:
            check_slots(model.backend, cache)
        except AssertionError as failure:
            seen["failed"].append(failure)

    cache._resize = checked_resize

    async def run():
        engine, budget = _engine(model, tokenizer, True, layer_split=(1,), groups=2)
        engine.start()
        replies = await asyncio.gather(*(_complete(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        _budget_holds(engine, budget)
        await engine.shutdown(1)
        return [r for r, _ in replies], engine

    replies, engine = asyncio.run(run())
    assert engine.cache.stats["parks"] == 0 and engine.cache.stats["dropped_blocks"] == 0
    assert cache.num_shrinks >= 1 and seen["failed"] == []
    assert seen["threads"] - {threading.main_thread().name}  # some resize ran on a stage's worker thread
    assert replies == _sequence(numpy_model, tokenizer, False)[0][:2]


def test_the_growth_check_grows_the_cache_back_once_the_pool_has_room_and_experts_miss(moe, monkeypatch):
    """The timer's path: with the check every 20 ms and no cooldown, after the operator shrinks the pool a
    request that misses experts makes the check ask for, and be granted, the slots back."""
    from engine.backends.cuda.expert_cache import budget as cuda_expert_cache_budget

    monkeypatch.setattr(cuda_expert_cache_budget, "GROW_CHECK_S", 0.02)
    monkeypatch.setattr(cuda_expert_cache_budget, "RECLAIM_COOLDOWN_S", 0.0)
    model, _, tokenizer = moe
    cache = model.backend.expert_cache

    async def after(engine, budget):
        await engine.resize_device_pool(MIN_BLOCKS)
        shrunk = cache.num_slots
        await _complete(engine, "b2", PROMPTS[1] + [9, 9, 9])
        for _ in range(100):
            if cache.num_slots == 16:
                break
            await asyncio.sleep(0.02)
        _budget_holds(engine, budget)
        return shrunk, budget.num_grow_backs

    _, _, engine, (shrunk, grow_backs) = _sequence(model, tokenizer, True, after)
    assert shrunk < 16 and cache.num_slots == 16 and grow_backs >= 1
    assert engine.cache.stats["dropped_blocks"] == 0
    check_slots(model.backend, cache)
