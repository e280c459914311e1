"""A thin layer over the CUDA driver API (cuda-python's `cuda.bindings.driver`): one `Device` per GPU.

A Device owns what every backend on that GPU shares: the primary context, the memory arena (one cuMemAlloc,
sub-allocated in Python, see cuda/arena.py), pinned host buffers and the loaded kernel modules (cuda/launch.py).
Streams and events are created here but owned by whoever asks (one stream per backend = pipeline stage).

Importing this module never fails: without cuda-python `driver` is None, and `probe()` says why there is no
GPU instead of raising, so the `auto` backend can fall back to numpy with a reason in the log.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np

from engine.backends.cuda.arena import ArenaAllocator
from engine.units import MIB

try:  # cuda-python >= 12.6 (`cuda.bindings`); nothing else of it is needed here
    from cuda.bindings import driver
    _IMPORT_ERROR = ""
except Exception as exc:  # noqa: BLE001 - any failure means "no cuda-python", and probe() reports it
    driver = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

log = logging.getLogger("strata.cuda")
ARENA_ENV = "STRATA_CUDA_ARENA_MIB"  # device memory the arena takes; default: ARENA_FRACTION of what is free
ARENA_FRACTION = 0.9
_outside_arena = {"bytes": 0}  # device memory the default arena leaves free (an elastic KV pool's chunks)


def leave_outside_arena(nbytes: int) -> None:
    """Have the devices made from now on leave nbytes outside their default-sized arena: the elastic KV pool
    (cuda/kv_elastic.py) maps its chunks from there. Without STRATA_CUDA_ARENA_MIB the arena takes
    ARENA_FRACTION of the free memory minus this; a device already made keeps its arena (the log says so)."""
    _outside_arena["bytes"] = int(nbytes)
    if _devices:
        log.warning("cuda: %d MiB asked to stay outside the arena after the device was opened; set %s instead",
                    nbytes // MIB, ARENA_ENV)
INSTALL_HINT = "pip install -e '.[cuda]'"


class CudaError(RuntimeError):
    """A driver call failed; the message names the call and the CUresult."""


def check(result, what: str = "CUDA call"):
    """Unpack a cuda-python result tuple (err, *values): raise CudaError on failure, else return the values."""
    err, values = result[0], result[1:]
    if int(err) != 0:
        raise CudaError(f"{what} failed: {error_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def error_name(err) -> str:
    try:
        status, name = driver.cuGetErrorName(err)
        return name.decode() if int(status) == 0 else str(err)
    except Exception:  # noqa: BLE001 - naming an error must never raise a second one
        return str(err)


def probe(ordinal: int = 0) -> tuple[bool, str]:
    """(available, reason): can device `ordinal` be used? Never raises."""
    if driver is None:
        return False, f"cuda-python not installed ({INSTALL_HINT})"
    try:
        err, = driver.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - cuda-python raises when libcuda.so is not found at all
        return False, f"no CUDA driver (libcuda not loadable: {type(exc).__name__})"
    if int(err) != 0:
        return False, f"no CUDA driver (cuInit: {error_name(err)})"
    try:
        count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
        if ordinal >= count:
            return False, f"no CUDA device {ordinal} ({count} found)"
        dev = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        name = check(driver.cuDeviceGetName(100, dev), "cuDeviceGetName").split(b"\0")[0].decode()
        major, minor = _capability(dev)
        return True, f"{name} (sm_{major}{minor})"
    except Exception as exc:  # noqa: BLE001
        return False, f"CUDA device {ordinal} unusable ({exc})"


def _capability(dev) -> tuple[int, int]:
    attr = driver.CUdevice_attribute
    major = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    return int(major), int(minor)


class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc): async copies from/to it overlap with compute.

    `array` is a uint8 numpy view of the whole buffer; `view(dtype, shape, offset)` a typed piece of it.
    """

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(check(driver.cuMemHostAlloc(max(nbytes, 1), 0), f"cuMemHostAlloc({nbytes})"))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(self.ptr))[:nbytes]

    def view(self, dtype, shape, offset: int = 0) -> np.ndarray:
        count = int(np.prod(shape))
        return self.array[offset : offset + count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)

    def close(self) -> None:
        if self.ptr:
            self.array = None
            driver.cuMemFreeHost(self.ptr)
            self.ptr = 0


class Device:
    """One GPU: primary context, memory arena and kernel modules, shared by every backend on it.

    Get it with `get_device(ordinal)`; the first call initialises the driver and takes the arena.
    """

    def __init__(self, ordinal: int):
        ok, reason = probe(ordinal)
        if not ok:
            raise RuntimeError(f"CUDA device {ordinal} is not usable: {reason}")
        self.ordinal = ordinal
        self.handle = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = check(driver.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self._thread_state = threading.local()  # .bound: this thread has the context current
        self.make_current()
        self.name = reason
        self.capability = _capability(self.handle)
        self.arch = f"sm_{self.capability[0]}{self.capability[1]}"
        attr = driver.CUdevice_attribute
        self.sm_count = int(check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                                              self.handle)))
        self.arena_bytes = self._arena_size()
        self.arena_base = int(check(driver.cuMemAlloc(self.arena_bytes), f"cuMemAlloc({self.arena_bytes})"))
        self.arena = ArenaAllocator(self.arena_bytes)
        self._lock = threading.Lock()  # several stages (threads) may allocate on one device
        log.info("cuda device %d: %s, %d SMs, arena %.0f MiB", ordinal, self.name, self.sm_count,
                 self.arena_bytes / MIB)

    def make_current(self) -> None:
        """Bind this device's context to the calling thread (every thread that calls the driver needs it)."""
        check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self._thread_state.bound = True

    def ensure_current(self) -> None:
        """make_current once per thread: the model loads on one thread, the engine steps on another."""
        if not getattr(self._thread_state, "bound", False):
            self.make_current()

    def _arena_size(self) -> int:
        free, total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
        if os.environ.get(ARENA_ENV):
            wanted = int(float(os.environ[ARENA_ENV]) * MIB)
            if wanted > free:
                raise ValueError(f"{ARENA_ENV}={os.environ[ARENA_ENV]} asks for more than the "
                                 f"{free // MIB} MiB free on the device")
            return wanted
        leave = _outside_arena["bytes"]
        if leave and leave > free * ARENA_FRACTION // 2:
            raise ValueError(f"--kv-cache-max-mib {leave // MIB} leaves less than half of the {free // MIB} MiB "
                             f"free on the device for weights and activations; lower it or set {ARENA_ENV}")
        return int(free * ARENA_FRACTION - leave) // MIB * MIB

    # -- memory -----------------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int | None:
        """Device address of nbytes from the arena, or None when it is full."""
        with self._lock:
            offset = self.arena.allocate(nbytes)
        return None if offset is None else self.arena_base + offset

    def unreserve(self, address: int) -> None:
        with self._lock:
            self.arena.free(address - self.arena_base)

    def alloc(self, nbytes: int, what: str) -> int:
        """Like reserve, but running out is an error naming what did not fit (weights, KV pool)."""
        address = self.reserve(nbytes)
        if address is None:
            raise MemoryError(f"not enough GPU memory for {what}: {nbytes / MIB:.0f} MiB wanted, largest "
                              f"free piece {self.arena.largest_free / MIB:.0f} MiB of the "
                              f"{self.arena_bytes / MIB:.0f} MiB arena (set {ARENA_ENV} or use fewer blocks)")
        return address

    # -- streams, events, copies ------------------------------------------------------------------------
    def create_stream(self):
        self.ensure_current()
        flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)  # never serialised with the NULL stream
        return check(driver.cuStreamCreate(flags), "cuStreamCreate")

    def create_event(self, timing: bool = False):
        self.ensure_current()
        flags = driver.CUevent_flags.CU_EVENT_DEFAULT if timing else driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return check(driver.cuEventCreate(int(flags)), "cuEventCreate")

    def htod(self, dst: int, src_host: int, nbytes: int, stream) -> None:
        self.ensure_current()
        if nbytes:
            check(driver.cuMemcpyHtoDAsync(dst, src_host, nbytes, stream), "cuMemcpyHtoDAsync")

    def dtoh(self, dst_host: int, src: int, nbytes: int, stream) -> None:
        self.ensure_current()
        if nbytes:
            check(driver.cuMemcpyDtoHAsync(dst_host, src, nbytes, stream), "cuMemcpyDtoHAsync")

    def dtod(self, dst: int, src: int, nbytes: int, stream) -> None:
        self.ensure_current()
        if nbytes:
            check(driver.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def fill_u32(self, dst: int, value: int, count: int, stream) -> None:
        """Set count 32-bit words (the tests poison outputs with NaN = 0x7fc00000 this way)."""
        self.ensure_current()
        if count:
            check(driver.cuMemsetD32Async(dst, value, count, stream), "cuMemsetD32Async")

    def synchronize(self, stream) -> None:
        self.ensure_current()
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def synchronize_context(self) -> None:
        """Wait for all work queued on this device by every stream (before memory is unmapped under it)."""
        self.ensure_current()
        check(driver.cuCtxSynchronize(), "cuCtxSynchronize")


_devices: dict[int, Device] = {}
_devices_lock = threading.Lock()


def get_device(ordinal: int = 0) -> Device:
    """The shared Device for a GPU ordinal (created on first call)."""
    with _devices_lock:
        if ordinal not in _devices:
            _devices[ordinal] = Device(ordinal)
        device = _devices[ordinal]
    device.make_current()
    return device
