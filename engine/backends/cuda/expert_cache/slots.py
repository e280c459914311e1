"""Which expert of which layer sits in which device slot of the expert cache: the policy, with no device in it.

A slot holds one expert of one layer (its gate, up and down matrices). `plan(layer, experts)` is called once per
MoE layer of a step with the experts its routing chose; it counts a hit for each one already in a slot and a miss
for each one that must be copied in, and assigns slots, evicting the least recently used expert of any layer that
this round does not need. When a layer needs more experts than there are slots (a long prefill with a small
cache), the experts are cut into rounds of at most `num_slots` consecutive ids; the backend computes round by
round, each round's loads queued after the previous round's kernels.

    resident (LRU order, oldest first):  (L0, e3) (L1, e0) (L0, e5) ...  each -> a slot id
    free slots: ids not holding an expert (taken lowest first)

Slot ids are always 0 .. num_slots-1: growing adds ids at the top; shrinking evicts the least recently used
experts until the rest fit and moves those left above the new top into free ids below (`resize`). Mutated only by the caller that owns the cache's lock.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class Round:
    """One round of a layer's step: the experts it computes (sorted ids) and the copies it needs first."""

    experts: tuple[int, ...]
    loads: tuple[tuple[int, int], ...]  # (expert, slot) to copy in before the round's kernels
    evicted: tuple[Key, ...]  # what those loads displaced, in eviction order
    slots: tuple[int, ...] = ()  # the slot of each of `experts` (hits and loads)


@dataclass
class LayerCounts:
    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class ExpertSlots:
    """LRU assignment of (layer, expert) keys to num_slots device slots."""

    num_slots: int
    _lru: OrderedDict = field(default_factory=OrderedDict)  # Key -> slot, least recently used first
    _free: list = field(default_factory=list)  # heap of free slot ids
    _next_slot: int = 0
    counts: dict = field(default_factory=dict)  # layer -> LayerCounts

    def __post_init__(self):
        assert self.num_slots >= 0
        self._free = list(range(self.num_slots))
        self._next_slot = self.num_slots

    def slot_of(self, layer: int, expert: int) -> int | None:
        return self._lru.get((layer, expert))

    def resident(self) -> list[Key]:
        """The cached experts, least recently used first."""
        return list(self._lru)

    @property
    def slot_ids(self) -> list[int]:
        return sorted([*self._lru.values(), *self._free])

    def plan(self, layer: int, experts) -> list[Round]:
        """Slots for the sorted unique expert ids a layer's step needs, as rounds (mutates: counts, LRU order,
        assignments). Needs num_slots >= 1."""
        assert self.num_slots >= 1, "an expert cache with no slots cannot run a step"
        experts = sorted(int(e) for e in experts)
        counts = self.counts.setdefault(layer, LayerCounts())
        rounds = []
        for start in range(0, len(experts), self.num_slots):
            chosen = experts[start : start + self.num_slots]
            needed = {(layer, e) for e in chosen}
            loads, evicted = [], []
            for expert in chosen:
                key = (layer, expert)
                if key in self._lru:
                    self._lru.move_to_end(key)
                    counts.hits += 1
                    continue
                counts.misses += 1
                slot = heapq.heappop(self._free) if self._free else self._evict_one(needed, evicted)
                self._lru[key] = slot
                loads.append((expert, slot))
            slots = tuple(self._lru[(layer, e)] for e in chosen)
            rounds.append(Round(tuple(chosen), tuple(loads), tuple(evicted), slots))
        return rounds

    def _evict_one(self, needed: set, evicted: list) -> int:
        victim = next(key for key in self._lru if key not in needed)  # exists: len(needed) <= num_slots
        evicted.append(victim)
        return self._lru.pop(victim)

    def resize(self, num_slots: int) -> tuple[list[int], list[int], list[Key], list[tuple[Key, int, int]]]:
        """Grow or shrink to num_slots between steps: (added slot ids, removed slot ids, evicted keys, moves).

        Slot ids stay 0 .. num_slots-1, so a shrink removes the top ids (the device memory behind them can be
        unmapped from the top): the least recently used experts are evicted until the rest fit, then each one
        left above the new top moves to a free id below it (`moves`: (key, old slot, new slot), a device copy
        the caller makes before the old slot's memory goes). LRU order is unchanged by a move."""
        assert num_slots >= 0
        added, evicted, moves = [], [], []
        while self.num_slots < num_slots:
            added.append(self._next_slot)
            heapq.heappush(self._free, self._next_slot)
            self._next_slot += 1
            self.num_slots += 1
        if self.num_slots <= num_slots:
            return added, [], evicted, moves
        while len(self._lru) > num_slots:
            key, slot = self._lru.popitem(last=False)
            evicted.append(key)
            self._free.append(slot)
        below = sorted(s for s in self._free if s < num_slots)
        for key, slot in self._lru.items():  # assigning a value keeps the key's LRU place
            if slot >= num_slots:
                new_slot = below.pop(0)
                self._lru[key] = new_slot
                moves.append((key, slot, new_slot))
        removed = list(range(num_slots, self.num_slots))
        self._free = below
        heapq.heapify(self._free)
        self.num_slots = self._next_slot = num_slots
        return added, removed, evicted, moves

    def check_integrity(self) -> None:
        """Every slot is free or holds exactly one expert; the counts add up."""
        held = list(self._lru.values())
        assert len(set(held)) == len(held), f"a slot holds two experts: {self._lru}"
        assert not set(held) & set(self._free), "a slot is both free and holding an expert"
        assert len(held) + len(self._free) == self.num_slots, (len(held), len(self._free), self.num_slots)
        assert sorted([*held, *self._free]) == list(range(self.num_slots)), "slot ids are not 0 .. num_slots-1"
