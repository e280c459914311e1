"""Kernel modules and launches: cubin from cuda_kernels (NVRTC, cached on disk per arch), loaded once per device.

Which source defines a kernel comes from `cuda_kernels.registry.SOURCES`; its launch shape from the companion
module `cuda_kernels/<stem>.py`: `geometry(kernel, **int_args) -> (grid, block, shared_bytes)`, given the
kernel's int arguments by name. Both are imported on first use, so the rest of the engine works without them.
"""
from __future__ import annotations

import ctypes
import importlib
import logging
import threading
import time
from collections import defaultdict
from pathlib import Path

from engine.backends.cuda import abi as cuda_abi
from engine.backends.cuda.device import check, driver

log = logging.getLogger("strata.cuda")
_DEFAULT_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
_kernel_sets: dict = {}  # Device -> its KernelSet (devices live as long as the process: cuda.device._devices)
_kernel_sets_lock = threading.Lock()


def kernel_set(device) -> "KernelSet":
    """The kernel modules of `device`, shared by all its backends (each compiled for its arch on first use)."""
    with _kernel_sets_lock:
        if device not in _kernel_sets:
            _kernel_sets[device] = KernelSet(device)
        return _kernel_sets[device]


class KernelSet:
    """Every kernel of the contract on one device: `launch(kernel, stream, **args)`.

    Modules are compiled and loaded per source file on first use of one of its kernels. Shared by all
    backends of the device (the functions are context-wide; the stream is the caller's).
    """

    def __init__(self, device):
        from cuda_kernels import registry  # imported here: NVRTC and the sources are only needed with a GPU

        self.device = device
        self._source_of = {k: src for src, kernels in registry.SOURCES.items() for k in kernels}
        self._modules: dict[str, object] = {}
        self._functions: dict[str, object] = {}
        self._geometry: dict[str, object] = {}
        self._shared_opt_in: dict[str, int] = {}
        self._lock = threading.Lock()
        self.profiler: KernelProfiler | None = None

    def load_all(self) -> None:
        """Compile (or read from the disk cache) and load every source now."""
        for kernel in self._source_of:
            self.function(kernel)

    def has(self, kernel: str) -> bool:
        return kernel in self._source_of

    def function(self, kernel: str):
        with self._lock:
            if kernel not in self._functions:
                source = self._source_of.get(kernel)
                if source is None:
                    raise KeyError(f"kernel {kernel!r} is not in cuda_kernels.registry.SOURCES")
                module = self._modules.get(source) or self._load(source)
                self._functions[kernel] = check(driver.cuModuleGetFunction(module, kernel.encode()),
                                                f"cuModuleGetFunction({kernel})")
            return self._functions[kernel]

    def _load(self, source: str):
        from cuda_kernels.build import compile_source

        started = time.perf_counter()
        compiled = compile_source(source, self.device.arch)
        module = check(driver.cuModuleLoadData(compiled.cubin), f"cuModuleLoadData({source})")
        self._modules[source] = module
        log.info("cuda kernels %s for %s: %d kernels, loaded in %.0f ms%s", source, self.device.arch,
                 len(compiled.kernels), (time.perf_counter() - started) * 1e3,
                 " (cached cubin)" if getattr(compiled, "cached", False) else "")
        return module

    def geometry(self, kernel: str, ints: dict[str, int]):
        """(grid3, block3, shared_bytes) from the kernel author's companion module."""
        source = self._source_of[kernel]
        if source not in self._geometry:
            self._geometry[source] = importlib.import_module(f"cuda_kernels.{Path(source).stem}").geometry
        grid, block, shared = self._geometry[source](kernel, **ints)
        return _dim3(grid), _dim3(block), int(shared)

    def launch(self, kernel: str, stream, **args) -> None:
        """Pack args in the contract's order (cuda_abi) and launch on stream."""
        values, ints = cuda_abi.pack(kernel, args)
        function = self.function(kernel)
        grid, block, shared = self.geometry(kernel, ints)
        if shared > _DEFAULT_SHARED_LIMIT and self._shared_opt_in.get(kernel, 0) < shared:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(driver.cuFuncSetAttribute(function, attr, shared), f"cuFuncSetAttribute({kernel})")
            self._shared_opt_in[kernel] = shared
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        profiler = self.profiler
        if profiler is not None:
            profiler.before(stream)
        # cuLaunchKernel copies the argument values before it returns, so `values` may die afterwards.
        check(driver.cuLaunchKernel(function, *grid, *block, shared, stream, ctypes.addressof(pointers), 0),
              f"cuLaunchKernel({kernel} grid={grid} block={block} shared={shared})")
        if profiler is not None:
            profiler.after(kernel, stream)


def _dim3(value) -> tuple[int, int, int]:
    if isinstance(value, int):
        return (value, 1, 1)
    dims = tuple(int(v) for v in value) + (1, 1, 1)
    assert all(d >= 1 for d in dims[:3]), f"empty launch dimension {value}"
    return dims[:3]


class KernelProfiler:
    """Per-kernel GPU time from a pair of events around every launch (benchmarks only: it adds launches).

    `collect()` synchronises on the events and returns {kernel: (launches, total ms)}.
    """

    def __init__(self, device):
        self.device = device
        self._spare: list = []
        self._pending: list[tuple[str, object, object]] = []
        self._start = None
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])

    def _event(self):
        return self._spare.pop() if self._spare else self.device.create_event(timing=True)

    def before(self, stream) -> None:
        self._start = self._event()
        check(driver.cuEventRecord(self._start, stream), "cuEventRecord")

    def after(self, kernel: str, stream) -> None:
        end = self._event()
        check(driver.cuEventRecord(end, stream), "cuEventRecord")
        self._pending.append((kernel, self._start, end))

    def collect(self) -> dict[str, tuple[int, float]]:
        for kernel, start, end in self._pending:
            check(driver.cuEventSynchronize(end), "cuEventSynchronize")
            ms = check(driver.cuEventElapsedTime(start, end), "cuEventElapsedTime")
            self.totals[kernel][0] += 1
            self.totals[kernel][1] += float(ms)
            self._spare += [start, end]
        self._pending.clear()
        return {k: (int(n), ms) for k, (n, ms) in self.totals.items()}
