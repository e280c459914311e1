"""CUDA virtual memory management for the fake drivers (tests/support/fake_cuda.py), on real host virtual memory.

    cuMemAddressReserve   mmap(PROT_NONE, MAP_NORESERVE): address space only, any access faults
    cuMemCreate           a memfd of the size (physical memory, filled 0xFF: cuMemCreate memory is not zeroed)
    cuMemMap              the memfd mapped MAP_FIXED | MAP_SHARED at the address, still PROT_NONE
    cuMemSetAccess        mprotect read-write: only now may kernels and copies touch it
    cuMemUnmap            the range back to a PROT_NONE reservation (the memfd keeps its bytes)
    cuMemRelease          the memfd closed (its pages go when no mapping holds them, as on the GPU)

So the semantics are the driver's: a mapped chunk shows its handle's bytes wherever it is mapped, sizes and
offsets are checked (granularity, offset 0, whole mappings), and touching an unmapped page is never silent.
Copies (cuMemcpy*, cuMemsetD32Async) and the numpy twins of the kernels (fake_cuda_kernels.view) check their
range first and fail with CUDA_ERROR_ILLEGAL_ADDRESS / an AssertionError; the real kernels under g++
(fake_cuda_emulated) fault with SIGSEGV, which a test sees from a child process.
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import os
import threading
import types

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_NONE, PROT_RW = 0, 3
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x1, 0x2, 0x10, 0x20, 0x4000
INVALID_VALUE, OUT_OF_MEMORY, ILLEGAL_ADDRESS = 1, 2, 700
GRANULARITY = 2 * 2**20  # what an H100/H200 reports

# Every live reservation of every fake driver, for the range checks: start -> _Reservation.
_RESERVATIONS: dict[int, "_Reservation"] = {}
_STARTS: list[int] = []
_LOCK = threading.Lock()


class _Reservation:
    def __init__(self, start: int, size: int):
        self.start, self.size = start, size
        self.mapped: dict[int, tuple[int, object]] = {}  # address -> (size, handle)
        self.accessible: set[int] = set()  # mapped addresses cuMemSetAccess made read-write

    def inaccessible(self, address: int, nbytes: int) -> int | None:
        """The first byte of [address, address + nbytes) inside this reservation that is not read-write."""
        lo, hi = max(address, self.start), min(address + nbytes, self.start + self.size)
        at = lo
        while at < hi:
            hit = next(((a, s) for a, (s, _) in self.mapped.items() if a <= at < a + s and a in self.accessible), None)
            if hit is None:
                return at
            at = hit[0] + hit[1]
        return None


def check_access(address: int, nbytes: int) -> str:
    """'' when [address, address + nbytes) touches no unmapped part of a reservation, else what it touches."""
    end = address + max(nbytes, 1)
    with _LOCK:
        j = bisect.bisect_left(_STARTS, end) - 1  # reservations do not overlap: walk down from the last start
        while j >= 0 and _RESERVATIONS[_STARTS[j]].start + _RESERVATIONS[_STARTS[j]].size > address:
            r = _RESERVATIONS[_STARTS[j]]
            bad = r.inaccessible(address, end - address)
            if bad is not None:
                return f"byte {bad:#x} ({bad - r.start} into the reservation at {r.start:#x}) is not mapped"
            j -= 1
    return ""


def _mmap(address: int, size: int, prot: int, flags: int, fd: int = -1) -> None:
    got = _libc.mmap(address, size, prot, flags, fd, 0)
    assert got == address, f"mmap at {address:#x} gave {got!r} (errno {ctypes.get_errno()})"


class FakeVmm:
    """The cuMem* virtual memory calls, mixed into FakeDriver. `vmm_granularity` and `vmm_limit_bytes`
    (physical memory the fake lets cuMemCreate take; None: no limit) may be set by a test."""

    CUmemLocation = type("CUmemLocation", (types.SimpleNamespace,), {})
    CUmemAllocationProp = type("CUmemAllocationProp", (types.SimpleNamespace,), {})
    CUmemAccessDesc = type("CUmemAccessDesc", (types.SimpleNamespace,), {})
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0,
                                                             CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)
    vmm_granularity = GRANULARITY
    vmm_limit_bytes: int | None = None

    def vmm_state(self):
        """The fake's virtual-memory bookkeeping: handles, physical bytes, and the calls in order (tests read
        `calls` to see the pool grow and shrink)."""
        if not hasattr(self, "_vmm"):
            self._vmm = types.SimpleNamespace(handles={}, physical=0, calls=[])
        return self._vmm

    @staticmethod
    def _prop_ok(prop) -> bool:
        return prop.type == 1 and prop.location.type == 1 and prop.location.id == 0

    def cuMemGetAllocationGranularity(self, prop, option):
        return (0, self.vmm_granularity) if self._prop_ok(prop) else (INVALID_VALUE, 0)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        if size % os.sysconf("SC_PAGE_SIZE") or size <= 0:
            return (INVALID_VALUE, 0)
        start = _libc.mmap(None, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        with _LOCK:
            _RESERVATIONS[start] = _Reservation(start, size)
            bisect.insort(_STARTS, start)
        self.vmm_state().calls.append(("reserve", start, size))
        return (0, start)

    def cuMemAddressFree(self, ptr, size):
        with _LOCK:
            r = _RESERVATIONS.get(int(ptr))
            if r is None or r.size != size or r.mapped:  # the driver refuses to free a range still mapped
                return (INVALID_VALUE,)
            del _RESERVATIONS[r.start]
            _STARTS.remove(r.start)
        _libc.munmap(r.start, r.size)
        return (0,)

    def cuMemCreate(self, size, prop, flags):
        state = self.vmm_state()
        if size % self.vmm_granularity or not self._prop_ok(prop):
            return (INVALID_VALUE, 0)
        if self.vmm_limit_bytes is not None and state.physical + size > self.vmm_limit_bytes:
            return (OUT_OF_MEMORY, 0)
        fd = os.memfd_create("fake-cuda-chunk")
        os.ftruncate(fd, size)
        os.pwrite(fd, b"\xff" * size, 0)
        handle = self._handle()
        state.handles[handle] = types.SimpleNamespace(fd=fd, size=size, maps=0, released=False)
        state.physical += size
        state.calls.append(("create", handle, size))
        return (0, handle)

    def _reservation(self, address: int, size: int) -> _Reservation | None:
        with _LOCK:
            for r in _RESERVATIONS.values():
                if r.start <= address and address + size <= r.start + r.size:
                    return r
        return None

    def cuMemMap(self, ptr, size, offset, handle, flags):
        h, r = self.vmm_state().handles.get(handle), self._reservation(int(ptr), size)
        if h is None or h.released or r is None or offset != 0 or size != h.size or (int(ptr) - r.start) % self.vmm_granularity:
            return (INVALID_VALUE,)
        if any(a < int(ptr) + size and int(ptr) < a + s for a, (s, _) in r.mapped.items()):
            return (INVALID_VALUE,)  # already mapped
        _mmap(int(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h.fd)
        with _LOCK:
            r.mapped[int(ptr)] = (size, handle)
        h.maps += 1
        self.vmm_state().calls.append(("map", int(ptr), size))
        return (0,)

    def cuMemSetAccess(self, ptr, size, descs, count):
        r = self._reservation(int(ptr), size)
        if r is None or count != 1 or descs[0].flags != 3 or descs[0].location.id != 0:
            return (INVALID_VALUE,)
        covered = [a for a, (s, _) in r.mapped.items() if int(ptr) <= a and a + s <= int(ptr) + size]
        if sum(r.mapped[a][0] for a in covered) != size:
            return (INVALID_VALUE,)  # every byte of the range must be mapped
        assert _libc.mprotect(int(ptr), size, PROT_RW) == 0
        with _LOCK:
            r.accessible.update(covered)
        return (0,)

    def cuMemUnmap(self, ptr, size):
        r = self._reservation(int(ptr), size)
        if r is None or r.mapped.get(int(ptr), (None,))[0] != size:
            return (INVALID_VALUE,)  # whole mappings only
        with _LOCK:
            _, handle = r.mapped.pop(int(ptr))
            r.accessible.discard(int(ptr))
        _mmap(int(ptr), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE)
        h = self.vmm_state().handles[handle]
        h.maps -= 1
        self._free_if_done(handle)
        self.vmm_state().calls.append(("unmap", int(ptr), size))
        return (0,)

    def cuMemRelease(self, handle):
        h = self.vmm_state().handles.get(handle)
        if h is None or h.released:
            return (INVALID_VALUE,)
        h.released = True
        os.close(h.fd)
        self._free_if_done(handle)
        return (0,)

    def _free_if_done(self, handle) -> None:
        state = self.vmm_state()
        h = state.handles[handle]
        if h.released and h.maps == 0:
            state.physical -= h.size
            del state.handles[handle]

    @property
    def physical_bytes(self) -> int:
        """Physical memory the fake's cuMemCreate chunks hold now (released and unmapped ones not counted)."""
        return self.vmm_state().physical

    def cuCtxSynchronize(self):
        return (0,)
