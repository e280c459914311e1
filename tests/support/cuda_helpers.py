"""Small helpers for the CUDA kernel tests: NVRTC compilation, a minimal driver-API device (context, memory,
launch), and random GGUF weights of every type the quantised kernels read."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

KERNEL_DIR = Path(__file__).resolve().parents[2] / "cuda_kernels"


def _ok(result, what: str):
    """cuda-python calls return (status, *values); raise on a bad status, return the value(s)."""
    status, *values = result
    if int(status) != 0:
        raise RuntimeError(f"{what} failed: {status!r}")
    return values[0] if len(values) == 1 else tuple(values)


def nvrtc_compile(source_name: str, arch: str) -> tuple[bytes, str]:
    """(CUBIN, compile log with ptxas -v resource lines) of cuda_kernels/<source_name> for `arch`."""
    from cuda.bindings import nvrtc

    from cuda_kernels.registry import read_source

    src = read_source(source_name).encode()
    prog = _ok(nvrtc.nvrtcCreateProgram(src, source_name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"--ptxas-options=-v"]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        log = b" " * _ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        _ok(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log_text = log.decode(errors="replace").rstrip("\x00 ")
        if int(status) != 0:
            raise RuntimeError(f"NVRTC failed on {source_name} for {arch}:\n{log_text}")
        cubin = b" " * _ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        _ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin, log_text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class Device:
    """Device 0 through the driver API: its primary context, module loading, buffers and launches.
    Buffers live until close(); tests are small, so nothing is freed earlier."""

    def __init__(self):
        from cuda.bindings import driver

        self.driver = driver
        _ok(driver.cuInit(0), "cuInit")
        self.device = _ok(driver.cuDeviceGet(0), "cuDeviceGet")
        self.context = _ok(driver.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        _ok(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        attr = driver.CUdevice_attribute
        major = _ok(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device), "cc")
        minor = _ok(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device), "cc")
        self.arch = f"sm_{major}{minor}"
        self._buffers = []
        self._modules = {}

    def function(self, cubin: bytes, name: str):
        if cubin not in self._modules:
            self._modules[cubin] = _ok(self.driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        module = self._modules[cubin]
        return _ok(self.driver.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")

    def upload(self, array: np.ndarray) -> int:
        """A new device buffer holding `array`; returns its address."""
        array = np.ascontiguousarray(array)
        ptr = _ok(self.driver.cuMemAlloc(max(array.nbytes, 1)), "cuMemAlloc")
        self._buffers.append(ptr)
        _ok(self.driver.cuMemcpyHtoD(ptr, array.ctypes.data, array.nbytes), "cuMemcpyHtoD")
        return int(ptr)

    def download(self, ptr: int, like: np.ndarray) -> np.ndarray:
        out = np.empty_like(like)
        _ok(self.driver.cuMemcpyDtoH(out.ctypes.data, ptr, out.nbytes), "cuMemcpyDtoH")
        return out

    def launch(self, function, grid, block, shared_bytes: int, args: list[tuple[str, int]]) -> None:
        """Launch and wait. args: ("ptr", address) or ("int", value), in the kernel's parameter order."""
        storage = [np.array([v], dtype=np.uint64 if kind == "ptr" else np.int32) for kind, v in args]
        params = np.array([s.ctypes.data for s in storage], dtype=np.uint64)
        _ok(self.driver.cuLaunchKernel(function, *grid, *block, shared_bytes, 0, params.ctypes.data, 0), "launch")
        _ok(self.driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def close(self) -> None:
        for ptr in self._buffers:
            self.driver.cuMemFree(ptr)
        self._buffers.clear()
        for module in self._modules.values():
            self.driver.cuModuleUnload(module)
        self._modules.clear()
        self.driver.cuDevicePrimaryCtxRelease(self.device)


def _random_k_blocks(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid Q4_K / Q6_K blocks (gguf cannot quantise these): random bits everywhere except the
    fp16 super-block scales, which are small finite values so dequantised weights stay O(1)."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    scale_offsets = {"Q4_K": (0, 2), "Q6_K": (208,)}[type_name]   # d, dmin / d
    for offset in scale_offsets:
        scale = rng.uniform(0.001, 0.01, size=n_blocks).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def random_weight(type_name: str, out: int, in_dim: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(GGUF bytes [out, row_bytes] uint8, their dequantised values [out, in_dim] float64)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q4_K", "Q6_K"):
        block_elems, _ = gguf.GGML_QUANT_SIZES[qtype]
        raw = _random_k_blocks(type_name, out * in_dim // block_elems, rng).reshape(out, -1)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((out, in_dim)).astype(np.float32), qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(out, -1)
    dense = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(out, in_dim)
    return raw, dense

