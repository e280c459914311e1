"""Plans granted before anything moves: a refused grant at any point (park, restore, spill, grow) leaves
every block where it was (exact free lists and tier maps), loses no conversation, and keeps integrity."""
import pytest

from scheduler.memory.admission import MemoryAdmission
from scheduler.cache.prefix_cache import PrefixCache

B = 4


def _cache():
    # 2 device blocks, a host tier of 2 grown one block at a time, 4 disk blocks.
    admission = MemoryAdmission(2, block_bytes=1, host_committed_blocks=0, segment_blocks=1)
    return PrefixCache(num_blocks=2, block_size=B, host_blocks=2, disk_blocks=4, admission=admission)


def _turn(cache, first):
    tokens = [first] * 8
    alloc = cache.allocate(cache.match(tokens, 7), 8)
    if alloc is not None:
        cache.release(tokens, 8, alloc)
    cache.check_integrity()
    return alloc


def _state(cache):
    tiers = lambda index: {k: b.tokens for k, b in index.items()}  # noqa: E731
    return (cache.tiers.free_ids("device"), cache.tiers.free_ids("host"), tiers(cache.tiers.blocks("device")),
            tiers(cache.tiers.blocks("host")), sorted(b.tokens for b in cache.tiers.blocks("disk").values()),
            cache.admission.host_committed_blocks, cache.stats["dropped_blocks"], list(cache.mover.moves))


def _conversations_kept(cache, firsts):
    return all(cache.match([f] * 8 + [0], 8).num_tokens == 8 for f in firsts)


@pytest.mark.parametrize("point, setup, turn", [
    ("grow", [1], 2),  # parking conversation 1 needs the host tier to grow
    ("park", [1], 2),
    ("spill", [1, 2], 3),  # host full: conversation 1 must go to disk
    ("restore", [1, 2], 1),  # a hit on parked blocks
])
def test_a_refused_grant_leaves_every_block_where_it_was(point, setup, turn):
    cache = _cache()
    for first in setup:
        assert _turn(cache, first) is not None
    before = _state(cache)
    cache.admission.refuse_points = {point}
    assert _turn(cache, turn) is None
    assert _state(cache) == before and cache.admission.refusals == 1
    assert _conversations_kept(cache, setup)
    cache.admission.refuse_points = set()
    assert _turn(cache, turn) is not None  # granted now: it goes ahead, and still nothing is lost
    assert _conversations_kept(cache, set(setup) | {turn}) and cache.stats["dropped_blocks"] == 0


def test_plans_change_nothing_until_applied():
    cache = _cache()
    _turn(cache, 1)
    before = _state(cache)
    plan = cache.plan_allocate(cache.match([2] * 8, 7), 8)
    assert [b.tokens for b in plan.parks] == [(1, 1, 1, 1), (1, 1, 1, 1)] and plan.host_grow == 2
    assert plan.points == {"park", "grow"} and _state(cache) == before


def test_exact_moves_of_a_spill_park_and_restore():
    cache = _cache()
    for first in (1, 2, 3):
        _turn(cache, first)
    # conversation 1 went to disk (its tail first), 2 to host, 3 is on the device
    assert cache.mover.moves == [("grow_host", 2), ("park", 1, 0), ("park", 0, 1),  # two segments, one plan
                                 ("save", (1, 1, 1, 1)), ("save", (1, 1, 1, 1)), ("park", 0, 0), ("park", 1, 1)]
    assert cache.tiers.free_ids("device") == [] and cache.tiers.free_ids("host") == []
    assert {b.tokens[0] for b in cache.tiers.blocks("host").values()} == {2} and len(cache.tiers.blocks("disk")) == 2
