"""The memory admission as one coroutine: requests for memory are served in arrival order, each planned at
its turn (never a plan made before an await), the engine's grants served inline after what is queued, and
other budget holders take device memory by shrinking the KV pool (parks, never drops) or are refused whole."""
import asyncio

import pytest

from scheduler.cache.device_pool import resize_pool
from tests.support.cache_requests import serve_request_via
from tests.support.memory_service_setup import cache_state, create_service


def test_queued_requests_are_served_in_arrival_order_and_the_engine_grant_waits_its_turn():
    service, cache = create_service()
    order = []

    async def main():
        service.start()
        first = asyncio.ensure_future(service.request(lambda: order.append("first") or 1, "first"))
        second = asyncio.ensure_future(service.request(lambda: order.append("second") or 2, "second"))
        await asyncio.sleep(0)  # both queued, not served yet: the admission task has not run
        assert order == [] and service.num_queued == 2
        service.grant(lambda: order.append("engine"))  # the engine's plan: after the two queued before it
        assert order == ["first", "second", "engine"] and service.num_queued == 0
        assert await first == 1 and await second == 2
        third = await service.request(lambda: order.append("third") or 3, "third")  # the task serves it
        await service.close()
        return third

    assert asyncio.run(main()) == 3 and order[-1] == "third"


def test_a_queued_shrink_plans_at_its_turn_not_when_asked():
    """A shrink asked while ids 4-7 were cached and movable; a request queued ahead of it pins them. The
    shrink planned when asked would park blocks a running request now holds; planned at its turn, it stops."""
    service, cache = create_service(reserved=8)
    serve_request_via(service, cache, [1] * 8)  # ids 0-1
    serve_request_via(service, cache, [2] * 24)  # grows to 8, ids 2-7
    stale = cache.plan_shrink(4)
    assert stale.shrink_to == 4 and any(b.tokens[0] == 2 for b in stale.parks + [b for b, _ in stale.relocations])

    async def main():
        service.start()
        pin = lambda: service.grant_plan(lambda: cache.plan_allocate(cache.match([2] * 24 + [3], 24), 25))  # noqa
        held = asyncio.ensure_future(service.request(pin, "a holder ahead"))
        resize = asyncio.ensure_future(service.request(lambda: resize_pool(service, 4), "resize"))
        await asyncio.sleep(0)
        assert service.num_queued == 2 and cache.plan_shrink(4).shrink_to == 4  # as it was when asked
        held, state = await held, await resize
        await service.close()
        assert held.granted
        return state, held.allocation

    state, held = asyncio.run(main())
    cache.check_integrity()
    assert state["device_blocks"] > 4 and "in use by a running request" in state["stopped_by"]
    assert all(cache.tiers.blocks("device")[i].ref_count for i in range(state["device_blocks"], 8) if i in cache.tiers.blocks("device"))
    assert cache.stats["dropped_blocks"] == 0 and cache.match([1] * 8 + [0], 8).num_tokens == 8


def test_a_refused_queued_shrink_leaves_every_block_where_it_was():
    service, cache = create_service(reserved=8)
    serve_request_via(service, cache, [1] * 32)  # the pool grows to 8, every id cached
    before = cache_state(cache)
    cache.admission.refuse_points = {"park"}
    state = asyncio.run(service.request(lambda: resize_pool(service, 4), "resize"))
    assert state["stopped_by"] == "the memory admission refused the moves" and state["device_blocks"] == 8
    assert cache_state(cache) == before and cache.admission.refusals == 1 and cache.stats["refused_plans"] == 1
    cache.check_integrity()


def test_a_budget_holder_takes_spare_device_memory_then_shrinks_the_pool_by_parking():
    service, cache = create_service(min_blocks=4, reserved=12)
    experts = service.register_budget("experts")
    serve_request_via(service, cache, [1] * 32)  # grows to 8 blocks; 4 of the 12-block budget spare
    assert asyncio.run(experts.grow(4 * 64)) and cache.num_blocks == 8  # from the spare: nothing moved
    assert cache.admission.device_ceiling_blocks == 8 and cache.stats["parks"] == 0
    assert asyncio.run(experts.grow(2 * 64))  # 2 blocks more: the pool shrinks to 6, parking what was there
    assert cache.num_blocks == 6 and cache.stats["parks"] == 2 and cache.stats["dropped_blocks"] == 0
    assert experts.held_bytes == 6 * 64 and cache.admission.device_ceiling_blocks == 6
    assert cache.usage()["device_held_by_experts_mib"] == 0  # (6 * 64 bytes rounds to 0 MiB)
    cache.check_integrity()
    assert cache.match([1] * 32 + [0], 32).num_tokens == 32  # the conversation is whole
    experts.give_back(6 * 64)
    assert cache.admission.device_ceiling_blocks == 12 and cache.num_blocks == 6  # grows again only on need


def test_a_budget_holder_is_refused_whole_when_the_pool_cannot_shrink_far_enough():
    service, cache = create_service(min_blocks=4, reserved=8, host_blocks=1)
    experts = service.register_budget("experts")
    serve_request_via(service, cache, [1] * 32)  # 8 blocks cached; the host tier has room to park only one
    before = cache_state(cache)
    assert not asyncio.run(experts.grow(3 * 64))  # a shrink to 5 would stop at 7: refused, nothing moved
    assert cache_state(cache) == before and cache.admission.refusals == 1 and experts.held_bytes == 0
    assert not asyncio.run(experts.grow(5 * 64))  # below the pool's minimum: refused at once
    cache.check_integrity()


def test_register_budget_refuses_a_second_holder_of_the_same_name():
    service, _ = create_service()
    service.register_budget("experts")
    with pytest.raises(ValueError, match="registered already"):
        service.register_budget("experts")
    with pytest.raises(ValueError, match="device memory only"):
        service.register_budget("other", tier="host")
