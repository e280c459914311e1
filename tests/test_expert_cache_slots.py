"""The expert cache's slot policy (engine/backends/cuda/expert_cache/slots.py): exact hits, misses, slots and
eviction order on scripted routings, rounds when a layer needs more experts than there are slots, resizes."""
from engine.backends.cuda.expert_cache.slots import ExpertSlots


def _counts(slots):
    return {layer: (c.hits, c.misses) for layer, c in slots.counts.items()}


def test_hits_and_misses_are_exact_on_a_scripted_routing():
    slots = ExpertSlots(4)
    script = [(0, [1, 3]), (1, [0, 1]), (0, [1, 3]), (1, [1, 2]), (0, [3, 5]), (1, [0, 2])]
    for layer, experts in script:
        slots.plan(layer, experts)
        slots.check_integrity()
    # L0 [1,3] 2 misses; L1 [0,1] 2 misses; L0 [1,3] 2 hits; L1 [1,2] hit 1, miss 2 (evicts (1,0));
    # L0 [3,5] hit 3, miss 5 (evicts (0,1)); L1 [0,2] miss 0 (evicts (1,1)), hit 2
    assert _counts(slots) == {0: (3, 3), 1: (2, 4)}
    assert slots.resident() == [(0, 3), (0, 5), (1, 0), (1, 2)]


def test_loads_take_free_slots_lowest_first_then_evict_the_least_recently_used():
    slots = ExpertSlots(3)
    (r,) = slots.plan(0, [2, 0])
    assert r.loads == ((0, 0), (2, 1)) and r.evicted == ()
    (r,) = slots.plan(1, [4])
    assert r.loads == ((4, 2),)
    (r,) = slots.plan(0, [2])  # a hit: (0, 2) becomes the most recently used
    assert r.loads == () and slots.resident() == [(0, 0), (1, 4), (0, 2)]
    (r,) = slots.plan(1, [5, 6])  # evicts (0, 0) then (1, 4): never (0, 2), never one this round needs
    assert r.evicted == ((0, 0), (1, 4)) and r.loads == ((5, 0), (6, 2))
    assert slots.resident() == [(0, 2), (1, 5), (1, 6)]
    assert slots.slot_of(0, 2) == 1 and slots.slot_of(0, 0) is None
    slots.check_integrity()


def test_a_layer_needing_more_experts_than_slots_runs_in_rounds_of_consecutive_ids():
    slots = ExpertSlots(2)
    slots.plan(0, [1])
    rounds = slots.plan(0, [7, 1, 3, 5, 0])
    assert [r.experts for r in rounds] == [(0, 1), (3, 5), (7,)]
    assert rounds[0].loads == ((0, 1),)  # expert 1 was a hit; 0 took the free slot
    assert rounds[1].evicted == ((0, 0), (0, 1)) and rounds[2].evicted == ((0, 3),)
    assert _counts(slots) == {0: (1, 5)}
    slots.check_integrity()


def test_shrink_evicts_lru_until_the_rest_fit_and_moves_those_above_the_top_down():
    slots = ExpertSlots(4)
    slots.plan(0, [0, 1])
    slots.plan(1, [0])  # residents (LRU first): (0,0)@0 (0,1)@1 (1,0)@2; slot 3 free
    added, removed, evicted, moves = slots.resize(2)
    assert added == [] and removed == [2, 3] and evicted == [(0, 0)]
    assert moves == [((1, 0), 2, 0)]  # (1,0) sat above the new top: into the id (0,0) left
    assert slots.resident() == [(0, 1), (1, 0)] and slots.slot_ids == [0, 1]
    assert slots.slot_of(1, 0) == 0 and slots.slot_of(0, 1) == 1
    added, removed, evicted, moves = slots.resize(3)
    assert added == [2] and removed == [] and evicted == [] and moves == []
    (r,) = slots.plan(1, [7])
    assert r.loads == ((7, 2),)
    slots.check_integrity()


def test_a_shrink_with_free_ids_below_the_top_evicts_nothing():
    slots = ExpertSlots(4)
    slots.plan(0, [0, 1, 2, 3])
    slots.resize(4)
    slots.plan(1, [5])  # evicts (0,0) from slot 0
    _, _, evicted, _ = slots.resize(6)
    added, removed, evicted, moves = slots.resize(4)  # slots 4, 5 are free: nothing moves
    assert removed == [4, 5] and evicted == [] and moves == [] and len(slots.resident()) == 4
    slots.check_integrity()
