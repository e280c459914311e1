"""A CPU stand-in for the CUDA driver and the kernels of docs/CUDA_KERNELS.md, so the CUDA backend's own code
(pointer arithmetic, argument order, staging, graphs, KV transfers) runs in tests on machines without a GPU.

"Device memory" is host memory: every pointer is a real address, copies are memmoves, and each kernel is a
numpy function reading and writing memory through its pointer arguments. Launch arguments are packed and
checked by cuda_abi exactly as on the GPU. Work on a capturing stream is recorded and replayed by
cuGraphLaunch; a synchronisation of a capturing stream fails as it does on the GPU. Nothing here is a
reference for the kernels' numerics (that is the numpy backend); it checks the backend around them.
"""
from __future__ import annotations

import ctypes
import enum
import sys
import threading
import types

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from engine.backends.cuda import abi as cuda_abi
from tests.support.fake_cuda_kernels import KERNELS, view
from tests.support.fake_cuda_vmm import ILLEGAL_ADDRESS, FakeVmm, check_access

ARENA_BYTES = 512 * 2**20


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = ILLEGAL_ADDRESS
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900


OK = CUresult.CUDA_SUCCESS
_enum = types.SimpleNamespace


class FakeDriver(FakeVmm):
    """The subset of cuda.bindings.driver the backend calls, with the same (err, *values) results."""

    CUresult = CUresult
    CUdevice_attribute = _enum(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=1,
                               CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=2,
                               CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT=3)
    CUstream_flags = _enum(CU_STREAM_NON_BLOCKING=1)
    CUevent_flags = _enum(CU_EVENT_DEFAULT=0, CU_EVENT_DISABLE_TIMING=2)
    CUstreamCaptureMode = _enum(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1)
    CUfunction_attribute = _enum(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8)

    def __init__(self):
        self._keep: dict[int, np.ndarray] = {}  # address -> the numpy buffer behind it
        self.capturing: dict[int, list] = {}  # stream -> recorded work
        self._next_handle = 1
        self.launches: list[str] = []
        self._thread = threading.local()  # .context: what cuCtxSetCurrent made current in this thread

    def _handle(self) -> int:
        self._next_handle += 1
        return self._next_handle

    def _buffer(self, nbytes: int) -> int:
        buf = np.zeros(nbytes, dtype=np.uint8)
        self._keep[buf.ctypes.data] = buf
        return buf.ctypes.data

    # -- device, context, memory
    def cuInit(self, flags): return (OK,)
    def cuGetErrorName(self, err): return (OK, f"CUDA_ERROR_{int(err)}".encode())
    def cuDeviceGetCount(self): return (OK, 1)
    def cuDeviceGet(self, ordinal): return (OK, ordinal)
    def cuDeviceGetName(self, length, dev): return (OK, b"Fake GPU\0")
    def cuDeviceGetAttribute(self, attr, dev): return (OK, {1: 9, 2: 0, 3: 4}[attr])
    def cuDevicePrimaryCtxRetain(self, dev): return (OK, self._handle())
    def cuCtxSetCurrent(self, ctx):
        self._thread.context = ctx
        return (OK,)

    def has_context(self) -> bool:
        return getattr(self._thread, "context", None) is not None
    def cuMemGetInfo(self): return (OK, ARENA_BYTES, 2 * ARENA_BYTES)
    def cuMemAlloc(self, nbytes): return (OK, self._buffer(nbytes))
    def cuMemHostAlloc(self, nbytes, flags):
        if not self.has_context():
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT, 0)
        return (OK, self._buffer(nbytes))
    def cuMemFreeHost(self, ptr): self._keep.pop(int(ptr)); return (OK,)

    # -- work on streams (recorded while the stream is being captured)
    def run_on_stream(self, stream, work):
        """Run `work` on `stream`: now, or recorded while the stream is captured. Returns (CUresult,)."""
        if not self.has_context():  # as on a GPU: work from a thread without a current context fails
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if stream in self.capturing:
            self.capturing[stream].append(work)
        else:
            work()
        return (OK,)

    @staticmethod
    def unmapped(*ranges) -> bool:
        """Does any (address, nbytes) touch an unmapped part of a reserved range (tests/support/fake_cuda_vmm.py)?"""
        return any(check_access(int(address), int(n)) for address, n in ranges)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        if self.unmapped((dst, n), (src, n)):
            return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
        return self.run_on_stream(stream, lambda: ctypes.memmove(int(dst), int(src), n))
    cuMemcpyDtoHAsync = cuMemcpyDtoDAsync = cuMemcpyHtoDAsync

    def cuMemsetD32Async(self, dst, value, count, stream):
        if self.unmapped((dst, 4 * count)):
            return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
        return self.run_on_stream(stream, lambda: view(dst, count, np.uint32).fill(value))

    def cuStreamCreate(self, flags): return (OK, self._handle())
    def cuEventCreate(self, flags): return (OK, self._handle())
    def cuEventRecord(self, event, stream): return (OK,)
    def cuEventQuery(self, event): return (OK,)
    def cuEventSynchronize(self, event): return (OK,)
    def cuEventElapsedTime(self, start, end): return (OK, 0.001)
    def cuStreamWaitEvent(self, stream, event, flags): return (OK,)

    def cuStreamSynchronize(self, stream):
        return (CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,) if stream in self.capturing else (OK,)

    # -- graphs
    def cuStreamBeginCapture(self, stream, mode):
        self.capturing[stream] = []
        return (OK,)

    def cuStreamEndCapture(self, stream): return (OK, self.capturing.pop(stream))
    def cuGraphInstantiate(self, graph, flags): return (OK, list(graph))
    def cuGraphDestroy(self, graph): return (OK,)
    def cuGraphExecDestroy(self, graph_exec): return (OK,)

    def cuGraphLaunch(self, graph_exec, stream):
        for work in graph_exec:
            work()
        return (OK,)


class FakeKernelSet:
    """KernelSet stand-in: checks arguments against the contract (cuda_abi.pack), then runs numpy kernels."""

    def __init__(self, driver: FakeDriver):
        self.driver = driver
        self.profiler = None
        self.has_split = True

    def load_all(self) -> None:
        pass

    def has(self, kernel: str) -> bool:
        return not kernel.startswith("paged_attention_split_") or self.has_split

    def launch(self, kernel: str, stream, **args) -> None:
        values, ints = cuda_abi.pack(kernel, args)  # same checks as on the GPU: names, count, int range
        a = {cuda_abi.arg_name(p): (int(v.value or 0) if kind == "ptr" else v.value)
             for (p, kind), v in zip(cuda_abi.params(kernel), values)}
        self.driver.launches.append(kernel)
        base = kernel.split("_")[0] if kernel.startswith(("matvec_", "gemm_")) else kernel
        err, = self.driver.run_on_stream(stream, lambda: KERNELS[base](kernel, a))
        assert err == OK, f"{kernel} launched from a thread without a current context"


def driver_modules() -> tuple:
    """Every backend module that calls the driver through its own `driver` name (one list for every fake)."""
    from engine.backends.cuda import device as cuda_device
    from engine.backends.cuda import graphs as cuda_graphs
    from engine.backends.cuda import launch as cuda_launch
    from engine.backends.cuda import streams as cuda_streams
    from engine.backends.cuda import vmm as cuda_vmm

    return (cuda_device, cuda_graphs, cuda_launch, cuda_streams, cuda_vmm)


def patch_driver(monkeypatch, fake) -> None:
    for module in driver_modules():
        monkeypatch.setattr(module, "driver", fake)


def install(monkeypatch) -> FakeDriver:
    """Route every CUDA module of the backend to a fresh FakeDriver and FakeKernelSet."""
    from engine.backends.cuda import device as cuda_device
    from engine.backends.cuda import launch as cuda_launch

    fake = FakeDriver()
    patch_driver(monkeypatch, fake)
    monkeypatch.setattr(cuda_device, "_devices", {})
    monkeypatch.setattr(cuda_launch, "kernel_set", lambda device: device.__dict__.setdefault(
        "_fake_kernels", FakeKernelSet(fake)))
    monkeypatch.setitem(sys.modules, "cuda_kernels.quant_types", _fake_quant_types())
    monkeypatch.setenv("STRATA_CUDA_ARENA_MIB", str(ARENA_BYTES // 2**20))
    return fake


def _fake_quant_types() -> types.ModuleType:
    module = types.ModuleType("cuda_kernels.quant_types")
    module.supported = lambda t: Q(t) in (Q.F32, Q.F16, Q.Q4_0, Q.Q8_0)
    module.row_bytes = lambda t, in_dim: in_dim // GGML_QUANT_SIZES[Q(t)][0] * GGML_QUANT_SIZES[Q(t)][1]
    module.MATVEC_MAX_T = 8
    return module
