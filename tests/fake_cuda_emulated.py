"""The fake driver of tests/fake_cuda.py with the REAL kernels: `cuLaunchKernel` runs the kernel's CUDA source
on the CPU (tests/kernel_emulator.py, g++), with the grid, block and shared bytes the backend launched with and
the argument values read back out of the backend's `kernelParams` array by the kernel's own C signature.

So everything between the backend and the kernel is exercised as on a GPU: cuda_launch.KernelSet (module
loading, geometry from the companion modules, packing through cuda_abi into a void** array), int vs pointer
parameters, argument order, buffer sizes and offsets. Only NVRTC is replaced: `compile_source` hands back the
source name as the "cubin", and `cuModuleLoadData` builds that source for the host instead.
"""
from __future__ import annotations

import ctypes
import threading
import types
from pathlib import Path

from engine.backends import cuda_abi
from tests import fake_cuda
from tests.fake_cuda import OK, FakeDriver
from tests.kernel_emulator import EmulatedSource

_LIBRARIES: dict[tuple[Path, str], EmulatedSource] = {}  # loaded once per process: the g++ build is cached
# One emulated launch at a time: blocks share function-static __shared__ arrays and the dynamic shared base,
# and pipeline stages may launch from several threads.
_RUN_LOCK = threading.Lock()
_KINDS = {"float*": "ptr", "int": "int", "float": "float"}


def _kind(ctype: str) -> str:
    return "ptr" if ctype.endswith("*") else _KINDS[ctype]


class EmulatedDriver(FakeDriver):
    """FakeDriver plus modules and launches: the real kernels, run by the g++ emulator."""

    def __init__(self, build_dir: Path):
        super().__init__()
        self.build_dir = Path(build_dir)
        self._modules: dict[int, EmulatedSource] = {}
        self._functions: dict[int, tuple[EmulatedSource, str]] = {}

    def cuModuleLoadData(self, image: bytes):
        name = bytes(image).decode()
        key = (self.build_dir, name)
        if key not in _LIBRARIES:
            _LIBRARIES[key] = EmulatedSource(name, self.build_dir)
        handle = self._handle()
        self._modules[handle] = _LIBRARIES[key]
        return (OK, handle)

    def cuModuleGetFunction(self, module, name: bytes):
        source = self._modules[module]
        kernel = name.decode()
        assert kernel in source.params, f"{kernel} is not defined in {source.name}"
        self._check_contract(source, kernel)
        handle = self._handle()
        self._functions[handle] = (source, kernel)
        return (OK, handle)

    def cuFuncSetAttribute(self, function, attr, value):
        return (OK,)

    @staticmethod
    def _check_contract(source: EmulatedSource, kernel: str) -> None:
        """The backend packs by cuda_abi (the doc); the kernel reads by its own signature: they must agree
        in count, order and kind, or the GPU would read garbage."""
        ours = [(cuda_abi.arg_name(n), _kind(c)) for c, n in source.params[kernel]]
        theirs = [(cuda_abi.arg_name(n), k) for n, k in cuda_abi.params(kernel)]
        assert ours == theirs, f"{kernel}: kernel signature {ours} != contract {theirs}"

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, kernel_params, extra):
        source, kernel = self._functions[function]
        params = source.params[kernel]
        slots = (ctypes.c_void_p * len(params)).from_address(int(kernel_params))
        args = []  # read NOW: the backend's argument storage may be gone by the time a graph replays
        for (ctype, _), slot in zip(params, slots):
            if ctype.endswith("*"):
                args.append(ctypes.c_void_p(ctypes.c_void_p.from_address(slot).value))
            elif ctype == "int":
                args.append(ctypes.c_int(ctypes.c_int.from_address(slot).value))
            else:
                args.append(ctypes.c_float(ctypes.c_float.from_address(slot).value))
        self.launches.append(kernel)

        def work():
            with _RUN_LOCK:
                source.launch_raw(kernel, (gx, gy, gz), (bx, by, bz), int(shared), args)
        return self._run(stream, work)


def install(monkeypatch, build_dir: Path) -> EmulatedDriver:
    """Route the backend's CUDA modules to an EmulatedDriver with the real KernelSet and quant_types."""
    from cuda_kernels import build
    from engine.backends import cuda_backend, cuda_device, cuda_graphs, cuda_launch

    fake = EmulatedDriver(build_dir)
    for module in (cuda_device, cuda_backend, cuda_graphs, cuda_launch):
        monkeypatch.setattr(module, "driver", fake)
    monkeypatch.setattr(cuda_device, "_devices", {})
    monkeypatch.setattr(build, "compile_source", lambda source, arch="sm_90", extra_options=(): types.SimpleNamespace(
        cubin=source.encode(), kernels={}, cached=True, log="", compile_ms=0.0))
    monkeypatch.setenv("STRATA_CUDA_ARENA_MIB", str(fake_cuda.ARENA_BYTES // 2**20))
    return fake
