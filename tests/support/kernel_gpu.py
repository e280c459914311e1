"""Runs the CUDA kernels on a real GPU with the same `launch(kernel, **args)` interface as
tests/support/kernel_emulator.py, so the numpy-parity tests run on both (the GPU case skips without a device).

Cubins come from cuda_kernels.build for the device's own arch; every array argument is copied to the
device before the launch and back into the same numpy array after it, so tests read results in place.
"""
from __future__ import annotations

import numpy as np

from cuda_kernels import build, registry
from tests.support.kernel_emulator import check_array, kernel_params

_SCALARS = {"int": np.int32, "float": np.float32}


def _check(result, what: str):
    """cuda.bindings calls return (error, *values); raise on an error, return the values."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        raise RuntimeError(f"{what} failed: {error}")
    return values[0] if len(values) == 1 else values


def open_device() -> str:
    """Initialise the driver and make device 0's primary context current; returns its arch (sm_XY).
    Raises when no driver or device is present."""
    from cuda.bindings import driver

    _check(driver.cuInit(0), "cuInit")
    device = _check(driver.cuDeviceGet(0), "cuDeviceGet")
    context = _check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    _check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    attribute = driver.CUdevice_attribute
    major = _check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "major")
    minor = _check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "minor")
    return f"sm_{major}{minor}"


class GpuSource:
    """One .cu file loaded on the current device; `launch` runs a kernel over numpy arrays, in place."""

    def __init__(self, source: str, arch: str):
        from cuda.bindings import driver

        self.driver = driver
        self.name = registry.source_file_name(source)
        text = registry.read_source(self.name)
        self.params = {k: kernel_params(text, k) for k in registry.SOURCES[self.name]}
        self.module = _check(driver.cuModuleLoadData(build.compile_source(self.name, arch).cubin), "cuModuleLoadData")

    def launch(self, kernel: str, threads: int | None = None, **args) -> None:
        """Run `kernel` with arguments by name (arrays for pointers, Python numbers for scalars)."""
        driver = self.driver
        ints = {name: int(args[name]) for ctype, name in self.params[kernel] if ctype == "int"}
        grid, block, shared = registry.geometry(kernel, **ints)
        if threads is not None:
            block = (threads, 1, 1)
        function = _check(driver.cuModuleGetFunction(self.module, kernel.encode()), "cuModuleGetFunction")
        copies, holders = [], []  # (host array, device pointer); one numpy scalar per kernel argument
        try:
            for ctype, name in self.params[kernel]:
                value = args[name]
                if ctype.endswith("*"):
                    address = 0
                    if value is not None:
                        check_array(kernel, ctype, name, value)
                        pointer = _check(driver.cuMemAlloc(max(1, value.nbytes)), "cuMemAlloc")
                        _check(driver.cuMemcpyHtoD(pointer, value.ctypes.data, value.nbytes), "cuMemcpyHtoD")
                        copies.append((value, pointer))
                        address = int(pointer)
                    holders.append(np.array([address], dtype=np.uint64))
                else:
                    holders.append(np.array([value], dtype=_SCALARS[ctype]))
            pointers = np.array([h.ctypes.data for h in holders], dtype=np.uint64)
            _check(driver.cuLaunchKernel(function, *grid, *block, shared, 0, pointers.ctypes.data, 0), kernel)
            _check(driver.cuCtxSynchronize(), f"{kernel} (running)")
            for host, pointer in copies:
                _check(driver.cuMemcpyDtoH(host.ctypes.data, pointer, host.nbytes), "cuMemcpyDtoH")
        finally:
            for _, pointer in copies:
                driver.cuMemFree(pointer)
