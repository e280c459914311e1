"""The fake driver of tests/support/fake_cuda.py with the REAL kernels: `cuLaunchKernel` runs the kernel's CUDA source
on the CPU (tests/support/kernel_emulator.py, g++), with the grid, block and shared bytes the backend launched with and
the argument values read back out of the backend's `kernelParams` array by the kernel's own C signature.

So everything between the backend and the kernel is exercised as on a GPU: cuda.launch.KernelSet (module
loading, geometry from the companion modules, packing through cuda_abi into a void** array), int vs pointer
parameters, argument order, buffer sizes and offsets. Only NVRTC is replaced: `compile_source` hands back the
source name as the "cubin", and `cuModuleLoadData` builds that source for the host instead.
"""
from __future__ import annotations

import ctypes
import threading
import types
from pathlib import Path

from engine.backends.cuda import abi as cuda_abi
from tests.support import fake_cuda
from tests.support.fake_cuda import OK, FakeDriver
from tests.support.kernel_emulator import EmulatedSource

_LIBRARIES: dict[tuple[Path, str], EmulatedSource] = {}  # loaded once per process: the g++ build is cached
# One emulated launch at a time: blocks share function-static __shared__ arrays and the dynamic shared base,
# and pipeline stages may launch from several threads.
_RUN_LOCK = threading.Lock()
_KINDS = {"float*": "ptr", "int": "int", "float": "float"}
# Red zones: every device allocation gets REDZONE extra bytes of a NaN / negative-index pattern after its
# end, checked after every launch and copy, so a kernel writing past a buffer the backend sized too small
# (split-K partials, staging, an ld_y offset) fails at that launch instead of corrupting a neighbour.
REDZONE = 256
CANARY = bytes.fromhex("addec0ff") * (REDZONE // 4)  # 0xffc0dead: a NaN as float, negative as int32/int64
_NATURAL_ALIGNMENT = {"float*": 4, "int*": 4, "long long*": 8, "unsigned long long*": 8, "unsigned char*": 1,
                      "unsigned short*": 4, "signed char*": 4}  # K/V rows: f16 pairs and int8 scales are words


def _kind(ctype: str) -> str:
    return "ptr" if ctype.endswith("*") else _KINDS[ctype]


class EmulatedDriver(FakeDriver):
    """FakeDriver plus modules and launches: the real kernels, run by the g++ emulator."""

    def __init__(self, build_dir: Path):
        super().__init__()
        self.build_dir = Path(build_dir)
        self._modules: dict[int, EmulatedSource] = {}
        self._functions: dict[int, tuple[EmulatedSource, str]] = {}
        self.redzones: dict[int, int] = {}  # guarded allocation -> its size (the red zone starts there)
        self._redzone_lock = threading.Lock()

    def guard(self, address: int, nbytes: int) -> None:
        ctypes.memmove(address + nbytes, CANARY, REDZONE)
        with self._redzone_lock:
            self.redzones[address] = nbytes

    def unguard(self, address: int) -> None:
        with self._redzone_lock:
            self.redzones.pop(address, None)

    def check_redzones(self, what: str) -> None:
        with self._redzone_lock:
            zones = list(self.redzones.items())
        for address, nbytes in zones:
            if ctypes.string_at(address + nbytes, REDZONE) != CANARY:
                raise AssertionError(f"{what} wrote past the end of the {nbytes}-byte allocation at {address:#x}")

    def run_on_stream(self, stream, work, what: str = "a copy or memset"):
        def checked():
            work()
            self.check_redzones(what)
        return super().run_on_stream(stream, checked)

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
        grid_what = f"{kernel} grid=({gx}, {gy}, {gz}) block=({bx}, {by}, {bz})"
        args = []  # read NOW: the backend's argument storage may be gone by the time a graph replays
        for (ctype, name), slot in zip(params, slots):
            if ctype.endswith("*"):
                pointer = ctypes.c_void_p.from_address(slot).value
                self._check_alignment(kernel, ctype, name, pointer)
                args.append(ctypes.c_void_p(pointer))
            elif ctype == "int":
                args.append(ctypes.c_int(ctypes.c_int.from_address(slot).value))
            else:
                args.append(ctypes.c_float(ctypes.c_float.from_address(slot).value))
        self.launches.append(kernel)

        def work():
            with _RUN_LOCK:
                source.launch_raw(kernel, (gx, gy, gz), (bx, by, bz), int(shared), args)
        return self.run_on_stream(stream, work, grid_what)

    @staticmethod
    def _check_alignment(kernel: str, ctype: str, name: str, pointer: int | None) -> None:
        """A GPU faults on a misaligned load: natural alignment for every pointer, and 16 bytes for the
        quantised kernels' W and x, which they read with vector loads (docs/CUDA_KERNELS.md; y and bias need
        only 4: a fused part's are offset by its column start)."""
        if pointer is None:
            return
        need = _NATURAL_ALIGNMENT[ctype]
        if kernel.startswith(("matvec_", "gemm_")) and name in ("W", "x"):
            need = 16
        assert pointer % need == 0, f"{kernel}: {name} at {pointer:#x} is not {need}-byte aligned"


def install(monkeypatch, build_dir: Path) -> EmulatedDriver:
    """Route the backend's CUDA modules to an EmulatedDriver with the real KernelSet and quant_types."""
    from cuda_kernels import build
    from engine.backends.cuda import device as cuda_device

    fake = EmulatedDriver(build_dir)
    fake_cuda.patch_driver(monkeypatch, fake)
    monkeypatch.setattr(cuda_device, "_devices", {})
    monkeypatch.setattr(build, "compile_source", lambda source, arch="sm_90", extra_options=(): types.SimpleNamespace(
        cubin=source.encode(), kernels={}, cached=True, log="", compile_ms=0.0))
    monkeypatch.setenv("STRATA_CUDA_ARENA_MIB", str(fake_cuda.ARENA_BYTES // 2**20))
    _guard_allocations(monkeypatch, fake)
    return fake


def _guard_allocations(monkeypatch, fake: EmulatedDriver) -> None:
    """Give every workspace array (GrowingPool) and every persistent allocation (Device.alloc: weights, KV
    pools, graph inputs) a red zone after its end."""
    from engine.backends.cuda import arena as cuda_arena
    from engine.backends.cuda import device as cuda_device

    pool_allocate, pool_free = cuda_arena.GrowingPool.allocate, cuda_arena.GrowingPool.free
    device_alloc, device_unreserve = cuda_device.Device.alloc, cuda_device.Device.unreserve

    def allocate(pool, nbytes):
        address = pool_allocate(pool, nbytes + REDZONE)
        ctypes.memset(address, 0xFF, nbytes)  # workspace holds whatever the last user left (even with poison off)
        fake.guard(address, nbytes)
        return address

    def free(pool, address):
        fake.unguard(address)
        pool_free(pool, address)

    def alloc(device, nbytes, what):
        address = device_alloc(device, nbytes + REDZONE, what)
        ctypes.memset(address, 0xFF, nbytes)  # cuMemAlloc memory is not zeroed: NaN as float, -1 as int
        fake.guard(address, nbytes)
        return address

    def unreserve(device, address):
        fake.unguard(address)
        device_unreserve(device, address)

    monkeypatch.setattr(cuda_arena.GrowingPool, "allocate", allocate)
    monkeypatch.setattr(cuda_arena.GrowingPool, "free", free)
    monkeypatch.setattr(cuda_device.Device, "alloc", alloc)
    monkeypatch.setattr(cuda_device.Device, "unreserve", unreserve)
