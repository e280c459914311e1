"""The eviction index chooses exactly what the full scans chose (tests/support/eviction_reference.py), victim for
victim, on randomized workloads with every tier under pressure, refused grants, failed disk writes,
unreadable files and blocks loaded from disk (ties on last use); the index equals a full scan after every
operation (check_integrity), and a plan, granted or refused, leaves it untouched."""
import dataclasses
import random

import numpy as np
import pytest

import scheduler.cache.planner as planner_module
import scheduler.cache.room as room
import tests.support.eviction_reference as reference
from scheduler.cache.persistence import load_disk_index
from scheduler.cache.checkpoint_store import CheckpointStore
from scheduler.cache.checkpoints import Checkpoints
from scheduler.cache.disk_tier import DiskEntry
from scheduler.memory.admission import MemoryAdmission
from scheduler.cache.prefix_cache import PrefixCache
from scheduler.cache.write_behind import WriteBehind

B = 4


class _Compare:
    """plan_device_room run twice on the same state: the reference on a copy of the plan, the index on it."""

    def __init__(self):
        self.calls = self.victims = 0
        self.kinds: set[str] = set()

    def __call__(self, view, plan, count, exclude):
        reference.active = view.index.is_active
        copy = dataclasses.replace(plan, parks=list(plan.parks), device_drops=list(plan.device_drops),
                                   spills=list(plan.spills), host_drops=list(plan.host_drops),
                                   disk_drops=list(plan.disk_drops), copy_drops=list(plan.copy_drops),
                                   checkpoint_drops=list(plan.checkpoint_drops))
        before = _index_state(view)
        expected = reference.plan_device_room(view, copy, count, {id(b) for b in exclude})
        found = room.plan_device_room(view, plan, count, exclude)
        assert found == expected
        for name in ("parks", "device_drops", "spills", "host_drops", "disk_drops", "copy_drops"):
            got, want = getattr(plan, name), getattr(copy, name)
            assert [id(b) for b in got] == [id(b) for b in want], (name, [b.tokens for b in got],
                                                                   [b.tokens for b in want])
            if got:
                self.kinds.add(name)
        assert [(id(n), k) for n, k in plan.checkpoint_drops] == [(id(n), k) for n, k in copy.checkpoint_drops]
        if plan.checkpoint_drops:
            self.kinds.add("checkpoint_drops")
        moved = {id(b) for b in plan.parks + plan.spills + plan.host_drops}
        if any(id(n) in moved for n, _ in plan.checkpoint_drops):
            self.kinds.add("parked_without_some_states")  # issue 16: its states did not all fit the host tier
        assert plan.host_grow == copy.host_grow
        assert _index_state(view) == before, "a plan changed the index"
        self.calls += 1
        self.victims += len(plan.parks) + len(plan.device_drops)
        return found


def _index_state(cache):
    return [list(s) for s in (cache.index.device, cache.index.host, cache.index.disk)]


@pytest.fixture
def compare(monkeypatch):
    checker = _Compare()
    monkeypatch.setattr(planner_module, "plan_device_room", checker)
    yield checker
    reference.active = lambda block: False


def _cache(num_blocks=12, host_blocks=6, disk_blocks=8, machine_room=None, units=0, state_dir=None):
    """units > 0: a hybrid model's cache, each checkpoint `units` slots of its tier (files in state_dir)."""
    room = None if machine_room is None else (lambda: machine_room)  # bytes = blocks here (block_bytes 1)
    admission = MemoryAdmission(host_blocks, block_bytes=1, host_committed_blocks=0, segment_blocks=2,
                                machine_room_bytes=room)
    store = CheckpointStore((1, 1, 2), state_dir, b"k")
    checkpoints = Checkpoints(units, every_blocks=1, store=store) if units else None
    return PrefixCache(num_blocks=num_blocks, block_size=B, host_blocks=host_blocks, disk_blocks=disk_blocks,
                       admission=admission, checkpoints=checkpoints)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _workload(cache, seed, steps, keys=False):
    """Random turns of a few conversations (continued, branched, new), grown step by step, some finished,
    some preempted, a share of grants refused; integrity after every operation."""
    rng = random.Random(seed)
    writer = WriteBehind(cache, block_bytes=2**20, mib_per_s=1) if cache.disk_blocks else None
    clock = _Clock()
    cache.activity.clock = clock
    history: dict[int, list[int]] = {}
    running = []  # (tokens, computed, allocation, key)
    for _ in range(steps):
        clock.now += rng.choice([1, 1, 5, 400])  # sometimes past the active window
        refuse = rng.random() < 0.1
        cache.admission.refuse_points = {rng.choice(["park", "spill", "grow", "restore"])} if refuse else set()
        cache.mover.fail_saves = rng.random() < 0.05
        if writer is not None and rng.random() < 0.3:
            writer.tick(writer.last_tick + rng.choice([1, 2, 3]))  # 1-3 blocks written behind
        action = rng.random()
        if action < 0.45 and len(running) < 3:
            conv = rng.randrange(6)
            past = history.get(conv, [])
            if past and rng.random() < 0.3:
                past = past[: rng.randrange(len(past))]  # an edited history: a branch
            tokens = past + [rng.randrange(1, 9) for _ in range(rng.randrange(1, 9))]
            on_disk = cache.tiers.blocks("disk")
            if rng.random() < 0.1 and on_disk:
                cache.mover.unreadable = {rng.choice(list(on_disk.values())).digest}
            key = f"k{conv}" if keys and conv % 2 else None
            match = cache.match(tokens, len(tokens) - 1, conversation=key)
            first = min(len(tokens), match.num_tokens + rng.randrange(1, 7))
            ckpts = rng.randrange(3) if cache.ckpt.enabled else 0  # hybrid: checkpoints it will take
            plan = cache.plan_allocate(match, first, checkpoints=ckpts)
            if plan is None and ckpts:  # as the engine loop: without room for them, it goes without
                plan = cache.plan_allocate(match, first)
            alloc = cache.apply(plan) if plan is not None and cache.admission.grant(plan) else None
            cache.mover.unreadable = set()
            if alloc is not None:
                running.append([conv, tokens, alloc.cached_tokens, alloc])
        elif action < 0.8 and running:
            item = rng.choice(running)
            n = rng.randrange(1, 6)
            if item[2] + n > len(item[1]):
                item[1] = item[1] + [rng.randrange(1, 9) for _ in range(item[2] + n - len(item[1]))]
            alloc = item[3]
            more = rng.randrange(2) if cache.ckpt.enabled else 0
            plan = cache.plan_extend(alloc, item[2] + n, checkpoints=more)
            if plan is None and more:
                plan = cache.plan_extend(alloc, item[2] + n)
            if plan is None and alloc.checkpoints_reserved and rng.random() < 0.5:
                cache.ckpt.give_up_pending(alloc)
            elif plan is not None and cache.admission.grant(plan) and cache.apply(plan) is not None:
                for _ in range(min(alloc.checkpoints_reserved - 1 - len(alloc.pending_checkpoints), n)):
                    position = item[2] + rng.randrange(1, n + 1)  # a state taken inside the step
                    cache.ckpt.take(alloc, position, np.full((1, 1, 2), position, np.float32))
                item[2] += n
        elif running:
            item = running.pop(rng.randrange(len(running)))
            conv, tokens, computed, alloc = item
            state = np.full((1, 1, 2), computed, np.float32) if cache.ckpt.enabled else None
            if rng.random() < 0.2:
                cache.apply(cache.plan_release(tokens, computed, alloc, kind="preempt", final_state=state))
            else:
                cache.apply(cache.plan_release(tokens, computed, alloc, final_state=state))
                history[conv] = tokens
        cache.check_integrity()
    for conv, tokens, computed, alloc in running:
        cache.release(tokens, computed, alloc)
    cache.check_integrity()
    return writer


@pytest.mark.parametrize("units,seed", [(1, 0), (1, 1), (2, 2), (3, 3)])
def test_index_chooses_the_same_victims_with_state_checkpoints_weighing_in(compare, tmp_path, units, seed):
    """Hybrid models: a victim frees its block and its checkpoints' slots; pinned blocks' checkpoints go
    when nothing else frees enough; checkpoints written behind cost disk slots and go with their block's
    copy; the order is the same as without them."""
    cache = _cache(num_blocks=14, host_blocks=8, disk_blocks=10, units=units, state_dir=tmp_path)
    writer = _workload(cache, seed, 1500, keys=seed % 2 == 1)
    stats = cache.ckpt.stats
    assert compare.calls > 200 and compare.victims > 200, (compare.calls, compare.victims)
    assert stats["attached"] > 50 and stats["dropped"] > 10, stats
    assert {"parks", "spills", "checkpoint_drops"} <= compare.kinds, compare.kinds
    assert writer.written_checkpoints > 0 and "copy_drops" in compare.kinds  # their files give way too


@pytest.mark.parametrize("units,seed", [(2, 4), (3, 5)])
def test_index_parks_a_block_with_the_states_a_small_host_tier_takes(compare, tmp_path, units, seed):
    """A host tier smaller than a block and its states: the block is parked with the states that fit (the
    rest dropped, least useful first), as in the reference; before, it was dropped with all of them."""
    cache = _cache(num_blocks=14, host_blocks=4, disk_blocks=10, units=units, state_dir=tmp_path)
    _workload(cache, seed, 1000, keys=False)
    assert compare.calls > 100 and compare.victims > 100, (compare.calls, compare.victims)
    assert {"parks", "spills", "parked_without_some_states"} <= compare.kinds, compare.kinds


@pytest.mark.parametrize("seed", range(6))
def test_index_chooses_the_same_victims_as_the_full_scan(compare, seed):
    cache = _cache()
    _workload(cache, seed, 1500, keys=seed % 2 == 1)
    assert compare.calls > 200 and compare.victims > 200, (compare.calls, compare.victims)


def test_every_kind_of_eviction_was_compared(compare):
    # the last two: the machine refuses host growth past 2 slots, or at all (victims dropped on the device)
    for seed, config in enumerate([(12, 6, 8), (10, 2, 0), (9, 3, 2), (10, 6, 4, 2), (10, 6, 4, 0)]):
        _workload(_cache(*config), seed, 1500, keys=True)
    assert compare.kinds == {"parks", "device_drops", "spills", "host_drops", "disk_drops", "copy_drops"}


def test_same_victims_without_host_or_disk_tiers(compare):
    cache = PrefixCache(num_blocks=10, block_size=B)
    _workload(cache, 11, 1500)
    assert compare.kinds == {"device_drops"}


def test_same_victims_among_blocks_loaded_from_disk_that_tie_on_last_use(compare):
    first = _cache(disk_blocks=40)
    _workload(first, 3, 600)
    blocks = [b for b in first.tiers.blocks("disk").values()]
    blocks += [b for b in [*first.tiers.blocks("device").values(), *first.tiers.blocks("host").values()]]
    entries = [DiskEntry(b.digest, b.parent.digest, b.tokens) for b in blocks]
    second = _cache(disk_blocks=10)  # fewer than were saved: the disk tier is full from the start
    assert load_disk_index(second, entries) > 5
    second.check_integrity()
    assert {b.last_used for b in second.tiers.blocks("disk").values()} == {0}
    _workload(second, 4, 1500)
    assert "disk_drops" in compare.kinds


def test_a_refused_plan_leaves_the_index_exactly_as_it_was():
    cache = _cache(num_blocks=4, host_blocks=2, disk_blocks=2)
    for first in (1, 2, 3):
        tokens = [first] * 8
        alloc = cache.allocate(cache.match(tokens, 7), 8)
        cache.release(tokens, 8, alloc)
    before = _index_state(cache)
    cache.admission.refuse_points = {"park"}
    assert cache.allocate(cache.match([4] * 8, 7), 8) is None
    assert _index_state(cache) == before
    cache.check_integrity()


def test_num_free_counts_unpinned_cached_blocks_from_the_index():
    cache = PrefixCache(num_blocks=8, block_size=B)
    alloc = cache.allocate(cache.match([1] * 12, 11), 12)
    cache.release([1] * 12, 12, alloc)  # 3 blocks cached, unpinned
    assert cache.num_free == 8 and cache.index.num_unpinned_device == 3
    held = cache.allocate(cache.match([1] * 9, 8), 12)  # pins the first two, copies from none
    assert cache.num_free == 8 - 2 - 1 and cache.usage()["device_in_use"] == 3
    cache.release([1] * 9, 9, held)
    cache.check_integrity()


def test_eviction_keys_are_unique_and_sorted_through_splits_and_removals():
    """The index's candidate sets (sortedcontainers.SortedSet) hold each key once, in order, through adds
    and removals enough to split and empty its runs; removing an absent key raises; a block synced again
    keeps its one key; a set that lost a key its record holds fails the integrity check."""
    from sortedcontainers import SortedSet
    rng = random.Random(7)
    keys, present = SortedSet(), set()
    for _ in range(5000):
        key = (rng.random() < 0.5, rng.randrange(3000))
        if key in present:
            keys.remove(key)
            present.discard(key)
        else:
            keys.add(key)
            present.add(key)
    assert list(keys) == sorted(present) and len(keys) == len(present)
    for key in sorted(present):
        keys.remove(key)
    assert list(keys) == []
    with pytest.raises(KeyError):
        keys.remove((True, 1))
    cache = _cache()
    alloc = cache.allocate(cache.match([1] * 12, 11), 12)
    cache.release([1] * 12, 12, alloc)
    before = list(cache.index.device)
    for block in list(cache.tiers.blocks("device").values()):
        cache.index.sync(block)
    assert list(cache.index.device) == before and len(before) == 3
    cache.index.device.remove(before[0])  # the record still holds it
    with pytest.raises(AssertionError, match="device candidates disagree"):
        cache.check_integrity()
