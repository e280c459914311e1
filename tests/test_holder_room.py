"""The KV pool takes room back from a budget holder (the MoE expert cache) before it parks a conversation:
scheduler/memory/holders.room_from_holders under MemoryService.grant, with a scripted holder (the expert cache's
own tier is tests/test_expert_budget.py). Block bytes 64, 4-block growth segments."""
import asyncio

from tests.support.cache_requests import serve_request_via
from tests.support.memory_service_setup import cache_state, create_service

BLOCK = 64


class ScriptedTier:
    """A holder's tier: gives back above `floor` bytes when asked, at once or when `release()` is called; like
    the expert cache's, a reclaim(n) asks for n in all, counting what is already on its way back."""

    def __init__(self, holder, floor: int, at_once: bool):
        self.holder, self.floor, self.at_once = holder, floor, at_once
        self.asked: list[int] = []
        self.owed = 0

    def reclaimable_bytes(self) -> int:
        return self.holder.held_bytes - self.floor

    def reclaim(self, nbytes: int) -> None:
        self.asked.append(nbytes)
        if self.at_once:
            self.holder.give_back(nbytes)
        else:
            self.owed = max(self.owed, nbytes)

    def release(self) -> None:
        self.holder.give_back(self.owed)
        self.owed = 0

    def start(self) -> None: ...

    def stop(self) -> None: ...


def _with_holder(held_blocks: int, floor_blocks: int, at_once: bool = False):
    service, cache = create_service(min_blocks=4, reserved=12, host_blocks=8)
    holder = service.register_budget("moe_experts")
    assert holder.grow_now(held_blocks * BLOCK)
    holder.attach(ScriptedTier(holder, floor_blocks * BLOCK, at_once))
    return service, cache, holder


def _allocate(service, cache, tokens):
    return service.grant(lambda: cache.plan_allocate(cache.match(tokens, len(tokens) - 1), len(tokens)))


def test_a_request_that_would_park_waits_for_the_holder_then_grows_into_what_it_gave_back():
    service, cache, holder = _with_holder(held_blocks=8, floor_blocks=2)
    serve_request_via(service, cache, [1] * 16)  # 4 blocks cached: the pool is at its ceiling (12 - 8)
    before = cache_state(cache)
    grant = _allocate(service, cache, [2] * 8)  # 2 fresh blocks: would park two of the conversation's
    assert not grant.granted and grant.plan is not None and not grant.plan.parks  # refused for now
    assert holder.user.asked == [2 * BLOCK]  # the fewest blocks that avoid the park, not all 6 it could give
    assert cache_state(cache) == before and service.num_waits_for_holders == 1
    grant = _allocate(service, cache, [2] * 8)  # asked again before the bytes are back: the same 2 in all
    assert not grant.granted and holder.user.asked == [2 * BLOCK, 2 * BLOCK] and holder.user.owed == 2 * BLOCK
    holder.user.release()
    grant = _allocate(service, cache, [2] * 8)
    assert grant.granted and grant.plan.device_grow == 2 and not grant.plan.parks
    assert cache.num_blocks == 6 and cache.stats["parks"] == 0 and cache.stats["dropped_blocks"] == 0
    assert holder.held_bytes == 6 * BLOCK and cache.match([1] * 16 + [0], 16).num_tokens == 16
    cache.check_integrity()


def test_a_holder_that_gives_back_at_once_lets_the_same_grant_through():
    service, cache, holder = _with_holder(held_blocks=8, floor_blocks=2, at_once=True)
    serve_request_via(service, cache, [1] * 16)
    grant = _allocate(service, cache, [2] * 8)
    assert grant.granted and not grant.plan.parks and cache.num_blocks == 6
    assert holder.user.asked == [2 * BLOCK] and cache.stats["parks"] == 0


def test_a_holder_at_its_floor_changes_nothing_the_pool_parks_as_without_it():
    service, cache, holder = _with_holder(held_blocks=8, floor_blocks=8)
    serve_request_via(service, cache, [1] * 16)
    grant = _allocate(service, cache, [2] * 8)
    assert grant.granted and len(grant.plan.parks) == 2 and holder.user.asked == []
    assert cache.stats["parks"] == 2 and cache.stats["dropped_blocks"] == 0 and holder.held_bytes == 8 * BLOCK
    cache.check_integrity()


def test_a_request_larger_than_the_ceiling_is_admitted_against_what_the_holder_could_give():
    service, cache, holder = _with_holder(held_blocks=8, floor_blocks=2)
    assert cache.admission.device_ceiling_blocks == 4 and service.device_reachable_blocks == 10
    holder.user.floor = 8 * BLOCK
    assert service.device_reachable_blocks == 4


def test_a_grow_without_parking_takes_only_spare_budget_and_free_ids():
    service, cache, holder = _with_holder(held_blocks=4, floor_blocks=2)
    serve_request_via(service, cache, [1] * 32)  # 8 blocks cached, ceiling 8: no spare, no free id
    before = cache_state(cache)
    assert not asyncio.run(holder.grow(2 * BLOCK, park=False))  # would park: refused whole
    assert cache_state(cache) == before
    assert asyncio.run(holder.grow(2 * BLOCK))  # parking allowed (the default): granted by parking 2
    assert cache.stats["parks"] == 2 and holder.held_bytes == 6 * BLOCK
