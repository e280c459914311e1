"""The device-memory sub-allocator's bookkeeping (pure Python: runs without a GPU)."""
import random

import pytest

from engine.backends.cuda.arena import ALIGNMENT, ArenaAllocator, GrowingPool


def test_allocations_are_aligned_first_fit_and_never_overlap():
    arena = ArenaAllocator(4096, alignment=256)
    assert [arena.allocate(n) for n in (1, 256, 257, 100)] == [0, 256, 512, 1024]
    assert arena.bytes_in_use == 256 + 256 + 512 + 256
    arena.check_integrity()


def test_full_arena_returns_none_instead_of_raising():
    arena = ArenaAllocator(1024, alignment=256)
    assert arena.allocate(1024) == 0
    assert arena.allocate(1) is None


def test_freed_neighbours_merge_back_into_one_range():
    arena = ArenaAllocator(1024, alignment=256)
    offsets = [arena.allocate(256) for _ in range(4)]
    for offset in (offsets[1], offsets[3], offsets[2], offsets[0]):
        arena.free(offset)
        arena.check_integrity()
    assert arena.largest_free == 1024 and arena.num_allocations == 0


def test_first_fit_reuses_the_lowest_hole():
    arena = ArenaAllocator(2048, alignment=256)
    a, b, c = arena.allocate(256), arena.allocate(512), arena.allocate(256)
    arena.free(b)
    assert arena.allocate(256) == b  # the hole left by b, not the end
    assert arena.allocate(512) == c + 256


def test_double_free_asserts():
    arena = ArenaAllocator(1024)
    offset = arena.allocate(10)
    arena.free(offset)
    with pytest.raises(AssertionError, match="double free"):
        arena.free(offset)


def test_random_workload_keeps_the_ranges_consistent():
    rng = random.Random(0)
    arena = ArenaAllocator(1 << 20)
    live = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            arena.free(offset)
            del live[offset]
        else:
            size = rng.randint(1, 40_000)
            offset = arena.allocate(size)
            if offset is not None:
                assert offset % ALIGNMENT == 0
                live[offset] = size
        arena.check_integrity()
    spans = sorted((o, o + s) for o, s in live.items())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_growing_pool_reserves_regions_on_demand_and_frees_into_them():
    reserved = []

    def reserve(nbytes):
        base = 0x10000 * (len(reserved) + 1)
        reserved.append((base, nbytes))
        return base

    pool = GrowingPool(reserve, region_bytes=1024)
    a = pool.allocate(1000)
    b = pool.allocate(600)  # does not fit the first region's remaining 0 bytes
    assert len(reserved) == 2 and a == 0x10000 and b == 0x20000
    big = pool.allocate(5000)  # larger than a region: a region of its own size
    assert reserved[-1][1] == 5120 and big == 0x30000
    pool.free(a)
    assert pool.allocate(512) == 0x10000  # reused, no new region
    assert len(reserved) == 3 and pool.bytes_in_use == 512 + 768 + 5120


def test_growing_pool_raises_memory_error_when_the_arena_is_full():
    pool = GrowingPool(lambda nbytes: None, region_bytes=1024)
    with pytest.raises(MemoryError, match="no room for 10 bytes"):
        pool.allocate(10)
