"""A sorted set of unique, totally ordered keys: O(log n) add and remove, in-order reads that change nothing.

The eviction index (scheduler/eviction_index.py) keeps its candidates here. A binary heap would need pops
to read its smallest entries; a plan must read them without mutating anything, so the keys are held as a
list of short sorted runs instead (the layout of the `sortedcontainers` package): a bisect over the runs'
maxima finds the run, a bisect inside it the place, and a run that grows past twice the load splits.

    _maxes  [k9,        k23,        k31]
    _runs   [[k1..k9],  [k11..k23], [k24..k31]]     every key of a run > every key of the run before
"""
from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any, Iterator

_LOAD = 256  # keys per run before it splits in two; runs of 256-512 keep bisect + list insert near 1 us


class SortedKeys:
    """Unique keys in ascending order. Iterating while adding or removing is not supported."""

    def __init__(self):
        self._runs: list[list[Any]] = []
        self._maxes: list[Any] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Any]:
        for run in self._runs:
            yield from run

    def add(self, key) -> None:
        if not self._runs:
            self._runs.append([key])
            self._maxes.append(key)
        else:
            i = min(bisect_left(self._maxes, key), len(self._runs) - 1)
            run = self._runs[i]
            insort(run, key)
            self._maxes[i] = run[-1]
            if len(run) > 2 * _LOAD:
                self._runs[i : i + 1] = [run[:_LOAD], run[_LOAD:]]
                self._maxes[i : i + 1] = [run[_LOAD - 1], run[-1]]
        self._len += 1

    def remove(self, key) -> None:
        """Remove a key that is present (asserts otherwise)."""
        i = bisect_left(self._maxes, key)
        assert i < len(self._runs), f"key not in the set: {key!r}"
        run = self._runs[i]
        j = bisect_left(run, key)
        assert j < len(run) and run[j] == key, f"key not in the set: {key!r}"
        del run[j]
        self._len -= 1
        if not run:
            del self._runs[i], self._maxes[i]
        else:
            self._maxes[i] = run[-1]

    def check(self) -> None:
        """Runs sorted, non-empty, strictly increasing across runs, maxima and length right."""
        flat = [k for run in self._runs for k in run]
        assert all(run for run in self._runs) and len(flat) == self._len, "sorted keys: empty run or bad length"
        assert all(a < b for a, b in zip(flat, flat[1:])), "sorted keys out of order"
        assert self._maxes == [run[-1] for run in self._runs], "sorted keys: stale run maxima"
