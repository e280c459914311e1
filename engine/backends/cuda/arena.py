"""Sub-allocation of device memory: pure-Python bookkeeping, no CUDA calls, so it is tested without a GPU.

The CUDA backend takes its device memory in one cuMemAlloc per device (the arena) and hands out pieces of it
itself: an allocation is a list operation instead of a driver call, nothing can fragment the driver's heap,
and the memory the server uses is one number decided at start.

    device arena   [ weights | KV pool | stage 0 workspace | stage 1 workspace | graph pool | ... free ... ]
                   ArenaAllocator over offsets: first fit, freed ranges merged with their neighbours
    workspace      GrowingPool: activations of one backend (one stream), regions reserved from the arena

Stream order makes reuse safe inside one pool: a pool belongs to one backend, whose work runs on one
stream, so memory freed by an earlier op and handed to a later one is only touched after the earlier op.
"""
from __future__ import annotations

import bisect
from typing import Callable

ALIGNMENT = 256  # bytes; cudaMalloc's own alignment, enough for every vector load the kernels do


def round_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


class ArenaAllocator:
    """First-fit free list over the byte range [0, size), every offset and length a multiple of alignment.

    `allocate` returns an offset or None when no free range is large enough (running out is an outcome the
    caller decides about); `free` takes back exactly an offset that `allocate` returned and merges it with
    free neighbours, so freeing everything restores one free range.
    """

    def __init__(self, size: int, alignment: int = ALIGNMENT):
        assert alignment > 0 and alignment & (alignment - 1) == 0, f"alignment {alignment} is not a power of 2"
        self.alignment = alignment
        self.size = size // alignment * alignment
        self._free_starts: list[int] = [0] if self.size else []  # sorted
        self._free_lengths: dict[int, int] = {0: self.size} if self.size else {}
        self._used: dict[int, int] = {}  # offset -> length

    @property
    def bytes_in_use(self) -> int:
        return sum(self._used.values())

    @property
    def bytes_free(self) -> int:
        return self.size - self.bytes_in_use

    @property
    def largest_free(self) -> int:
        return max(self._free_lengths.values(), default=0)

    @property
    def num_allocations(self) -> int:
        return len(self._used)

    def allocate(self, nbytes: int) -> int | None:
        length = round_up(max(nbytes, 1), self.alignment)
        for i, start in enumerate(self._free_starts):
            free_len = self._free_lengths[start]
            if free_len < length:
                continue
            del self._free_lengths[start]
            if free_len == length:
                del self._free_starts[i]
            else:
                self._free_starts[i] = start + length
                self._free_lengths[start + length] = free_len - length
            self._used[start] = length
            return start
        return None

    def free(self, offset: int) -> None:
        length = self._used.pop(offset, None)
        assert length is not None, f"free of offset {offset} that is not allocated (double free?)"
        i = bisect.bisect_left(self._free_starts, offset)
        end = offset + length
        if i < len(self._free_starts) and self._free_starts[i] == end:  # merge with the next free range
            length += self._free_lengths.pop(end)
            del self._free_starts[i]
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_lengths[prev] == offset:  # merge with the previous free range
                self._free_lengths[prev] += length
                return
        self._free_starts.insert(i, offset)
        self._free_lengths[offset] = length

    def check_integrity(self) -> None:
        """Free and used ranges tile [0, size) exactly, with no two free ranges adjacent."""
        ranges = sorted([(s, n, "free") for s, n in self._free_lengths.items()] +
                        [(s, n, "used") for s, n in self._used.items()])
        assert sorted(self._free_lengths) == self._free_starts, "free starts out of order"
        position, previous = 0, None
        for start, length, kind in ranges:
            assert start == position, f"gap or overlap at offset {position} (next range starts at {start})"
            assert start % self.alignment == 0 and length % self.alignment == 0 and length > 0
            assert not (kind == previous == "free"), f"adjacent free ranges at {start} were not merged"
            position, previous = start + length, kind
        assert position == self.size, f"ranges cover {position} of {self.size} bytes"


class GrowingPool:
    """Absolute addresses from regions reserved on demand through `reserve(nbytes) -> base or None`.

    Regions are never given back while the pool lives (a workspace reaches its peak in the first large step
    and stays there); `release_all` returns them through `unreserve` when the pool's owner closes.
    """

    def __init__(self, reserve: Callable[[int], int | None], region_bytes: int,
                 unreserve: Callable[[int], None] | None = None, alignment: int = ALIGNMENT):
        self._reserve, self._unreserve = reserve, unreserve
        self.region_bytes, self.alignment = region_bytes, alignment
        self._regions: list[tuple[int, ArenaAllocator]] = []  # (base address, allocator)
        self._owner: dict[int, ArenaAllocator] = {}  # address -> allocator of its region

    @property
    def reserved_bytes(self) -> int:
        return sum(a.size for _, a in self._regions)

    @property
    def bytes_in_use(self) -> int:
        return sum(a.bytes_in_use for _, a in self._regions)

    def allocate(self, nbytes: int) -> int:
        """An address of at least nbytes; raises MemoryError when no region fits and none can be reserved."""
        for base, alloc in self._regions:
            offset = alloc.allocate(nbytes)
            if offset is not None:
                self._owner[base + offset] = alloc
                return base + offset
        size = max(self.region_bytes, round_up(nbytes, self.alignment))
        base = self._reserve(size)
        if base is None:
            raise MemoryError(f"device memory exhausted: no room for {nbytes} bytes of activations "
                              f"({self.reserved_bytes} bytes already reserved for this workspace)")
        alloc = ArenaAllocator(size, self.alignment)
        self._regions.append((base, alloc))
        offset = alloc.allocate(nbytes)
        self._owner[base + offset] = alloc
        return base + offset

    def free(self, address: int) -> None:
        alloc = self._owner.pop(address, None)
        assert alloc is not None, f"free of address {address:#x} not allocated from this pool"
        base = next(b for b, a in self._regions if a is alloc)
        alloc.free(address - base)

    def release_all(self) -> None:
        if self._unreserve is not None:
            for base, _ in self._regions:
                self._unreserve(base)
        self._regions.clear()
        self._owner.clear()
