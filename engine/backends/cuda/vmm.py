"""One reserved device address range, backed by physical chunks as it grows and shrinks (CUDA virtual memory).

    reserved   base |-------------------------------------------------------------| size (costs no memory)
    mapped          |chunk 0|chunk 1|chunk 2|                                        physical, read-write
    map_to(n)       maps chunks at the top until n bytes are covered; unmaps and releases them from the top
                    down to the chunk that holds byte n-1

Addresses inside the range never change, so pointers computed from `base` (a KV pool's per-layer bases, a
block's address) stay valid through every grow and shrink; touching an unmapped part is an illegal address on
the GPU (and a loud failure in tests/support/fake_cuda_vmm.py). Each chunk is one cuMemCreate allocation of
`chunk_bytes` (a multiple of the device's allocation granularity, cuMemGetAllocationGranularity) mapped with
cuMemMap and made read-write for this device with cuMemSetAccess; a shrink is cuMemUnmap + cuMemRelease.
The physical memory comes from outside the device's arena (device.Device), so the arena must leave room
for it (STRATA_CUDA_ARENA_MIB).
"""
from __future__ import annotations

import logging

from engine.backends.cuda.arena import round_up
from engine.backends.cuda.device import CudaError, check, driver
from engine.units import MIB

log = logging.getLogger("strata.cuda")


def _location(ordinal: int):
    location = driver.CUmemLocation()
    location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    location.id = ordinal
    return location


def allocation_prop(ordinal: int):
    """Pinned device memory of GPU `ordinal` (the only kind a KV pool uses)."""
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _location(ordinal)
    return prop


def granularity(ordinal: int) -> int:
    """The size every physical chunk and mapping must be a multiple of (the recommended granularity)."""
    option = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(check(driver.cuMemGetAllocationGranularity(allocation_prop(ordinal), option),
                     "cuMemGetAllocationGranularity"))


class VirtualRange:
    """`size` bytes of device address space at `base`, of which the first `mapped_bytes` are backed.

    Not thread-safe; the caller orders map_to after the device work that reads what a shrink unmaps.
    """

    def __init__(self, device, size: int, chunk_hint: int):
        self.device = device
        device.ensure_current()
        gran = granularity(device.ordinal)
        self.chunk_bytes = round_up(max(chunk_hint, 1), gran)
        self.size = round_up(max(size, 1), self.chunk_bytes)
        self.base = int(check(driver.cuMemAddressReserve(self.size, 0, 0, 0), f"cuMemAddressReserve({self.size})"))
        self._prop = allocation_prop(device.ordinal)
        self._handles: list = []  # chunk i backs base + i * chunk_bytes

    @property
    def mapped_bytes(self) -> int:
        return len(self._handles) * self.chunk_bytes

    def map_to(self, nbytes: int) -> None:
        """Back the range's first nbytes (rounded up to whole chunks), mapping or unmapping at the top."""
        assert 0 <= nbytes <= self.size, f"{nbytes} bytes beyond the {self.size}-byte reservation"
        want = -(-nbytes // self.chunk_bytes)
        self.device.ensure_current()
        while len(self._handles) < want:
            self._map_chunk()
        while len(self._handles) > want:
            self._unmap_chunk()

    def _map_chunk(self) -> None:
        address = self.base + self.mapped_bytes
        result = driver.cuMemCreate(self.chunk_bytes, self._prop, 0)
        if int(result[0]) != 0:
            raise MemoryError(f"no GPU memory for another {self.chunk_bytes / MIB:.0f} MiB chunk of the KV pool "
                              f"({self.mapped_bytes / MIB:.0f} MiB mapped; cuMemCreate: {result[0]!r}); the "
                              f"device's arena (STRATA_CUDA_ARENA_MIB) must leave room for --kv-cache-max-mib")
        handle = result[1]
        try:
            check(driver.cuMemMap(address, self.chunk_bytes, 0, handle, 0), "cuMemMap")
        except CudaError:
            driver.cuMemRelease(handle)
            raise
        access = driver.CUmemAccessDesc()
        access.location = _location(self.device.ordinal)
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check(driver.cuMemSetAccess(address, self.chunk_bytes, [access], 1), "cuMemSetAccess")
        self._handles.append(handle)

    def _unmap_chunk(self) -> None:
        handle = self._handles.pop()
        check(driver.cuMemUnmap(self.base + self.mapped_bytes, self.chunk_bytes), "cuMemUnmap")
        check(driver.cuMemRelease(handle), "cuMemRelease")

    def close(self) -> None:
        """Unmap and release every chunk and give the address range back."""
        if self.base:
            self.map_to(0)
            check(driver.cuMemAddressFree(self.base, self.size), "cuMemAddressFree")
            self.base = 0
