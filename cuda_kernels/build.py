"""Compile the kernel sources with NVRTC to CUBIN for one exact GPU arch, with a disk cache.

CUBIN for the exact arch (`--gpu-architecture=sm_XX`) instead of PTX: the driver loads it as is, so the
PTX ISA version NVRTC writes never has to be one the installed driver understands. ptxas runs verbose, and
its per-kernel report (registers, shared memory, spill bytes) is parsed from the program log.

Cache: `$STRATA_HOME/kernels/<source stem>-<arch>-<key>.bin`, key = sha256 of the source text, the options,
the arch and the NVRTC version, so an edited kernel, a new option or an upgraded NVRTC never reuses an old
cubin. A file is written to a temporary name and renamed (readers never see half a file); a file that does
not parse or whose cubin hash does not match is compiled again and overwritten.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cuda_kernels import registry
from engine.model_store import strata_home

INSTALL_HINT = "pip install -e '.[cuda]'"
# The one home of the GPU archs: compiled by default (A100, RTX 30xx / A10, RTX 40xx / L4, H100 / H200), and every
# arch the pinned NVRTC 12.9 knows (pyproject.toml's cuda extra) that `strata kernels --check --arch` accepts.
DEFAULT_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
SUPPORTED_ARCHS = DEFAULT_ARCHS + ("sm_100", "sm_120")
# Parity with the numpy reference first: no --use_fast_math (approximate exp/div/sqrt) by default.
BASE_OPTIONS = ("--std=c++17", "-lineinfo", "--ptxas-options=-v")
_CACHE_MAGIC = b"STRATA-CUBIN-1\n"


class NvrtcUnavailable(RuntimeError):
    """cuda-python (with NVRTC) is not installed; the message carries the pip command that fixes it."""


class CompileError(RuntimeError):
    """NVRTC rejected a source; `.log` holds the compiler output."""

    def __init__(self, name: str, arch: str, log: str):
        super().__init__(f"NVRTC failed to compile {name} for {arch}:\n{log}")
        self.log = log


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel."""

    registers: int
    shared_bytes: int  # static shared memory
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


@dataclass
class CompiledSource:
    """A compiled source file: the cubin and what the compile reported."""

    name: str
    arch: str
    cubin: bytes
    log: str
    compile_ms: float  # of the original compile, also on a cache hit
    kernels: dict[str, KernelResources] = field(default_factory=dict)
    cached: bool = False


def load_nvrtc():
    """The nvrtc module of cuda-python (cuda.bindings in 12.6+ and 13.x, the older `cuda` namespace before)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # cuda-python < 12.6
        except ImportError as exc:
            raise NvrtcUnavailable(f"NVRTC is not available (cuda-python is not installed): {INSTALL_HINT}") from exc
    return nvrtc


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    nvrtc = load_nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    _check(nvrtc, err, "nvrtcVersion")
    return int(major), int(minor)


def compile_options(name: str, arch: str, extra_options=()) -> tuple[str, ...]:
    """Every option passed to NVRTC for this source and arch (part of the cache key)."""
    options = [f"--gpu-architecture={arch}", *BASE_OPTIONS]
    # NVRTC 13 ships the CUDA headers itself; our kernels are header-free, so this only matters for a source
    # that includes one (e.g. cuda_fp16.h), where it spares the user a toolkit include path.
    if nvrtc_version()[0] >= 13 and re.search(r"#\s*include\s*[<\"]cuda", registry.read_source(name)):
        options.append("--use-bundled-headers")
    return (*options, *extra_options)


def cache_key(source_text: str, options: tuple[str, ...], arch: str, version: tuple[int, int]) -> str:
    payload = json.dumps([source_text, list(options), arch, list(version)])
    return hashlib.sha256(payload.encode()).hexdigest()


def cache_dir() -> Path:
    return strata_home() / "kernels"


def compile_source(name: str, arch: str = "sm_90", extra_options=()) -> CompiledSource:
    """Compile one source file (`norms.cu`) for `arch`, or return the cached cubin from an earlier compile.

    Raises NvrtcUnavailable without cuda-python and CompileError (with the NVRTC log) on a bad source.
    """
    name = registry.source_file_name(name)
    text = registry.read_source(name)
    options = compile_options(name, arch, tuple(extra_options))
    key = cache_key(text, options, arch, nvrtc_version())
    path = cache_dir() / f"{Path(name).stem}-{arch}-{key[:32]}.bin"
    cached = _read_cache(path, name, arch)
    if cached is not None:
        return cached
    compiled = _run_nvrtc(name, text, arch, options)
    _write_cache(path, compiled)
    return compiled


def compile_all(arch: str = "sm_90", extra_options=()) -> dict[str, CompiledSource]:
    """Every discovered source compiled for `arch`, by source file name."""
    return {name: compile_source(name, arch, extra_options) for name in registry.SOURCES}


def _check(nvrtc, result, what: str) -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {result}")


def _run_nvrtc(name: str, text: str, arch: str, options: tuple[str, ...]) -> CompiledSource:
    nvrtc = load_nvrtc()
    err, program = nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], [])
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        started = time.perf_counter()
        (result,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        compile_ms = (time.perf_counter() - started) * 1000.0
        log = _program_log(nvrtc, program)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(name, arch, log)
        err, size = nvrtc.nvrtcGetCUBINSize(program)
        _check(nvrtc, err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(program, cubin)[0], "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return CompiledSource(name, arch, cubin, log, compile_ms, parse_resources(log))


def _program_log(nvrtc, program) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(program)
    _check(nvrtc, err, "nvrtcGetProgramLogSize")
    buffer = b" " * size
    _check(nvrtc, nvrtc.nvrtcGetProgramLog(program, buffer)[0], "nvrtcGetProgramLog")
    return buffer.rstrip(b"\x00 ").decode(errors="replace")


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")


def parse_resources(log: str) -> dict[str, KernelResources]:
    """ptxas -v output -> resources per kernel. Sections start at "Compiling entry function 'NAME'"."""
    kernels = {}
    sections = _ENTRY.split(log)  # [preamble, name1, text1, name2, text2, ...]
    for kernel, text in zip(sections[1::2], sections[2::2]):
        spills = _SPILLS.search(text)
        registers = _REGISTERS.search(text)
        shared = _SHARED.search(text)
        stack, stores, loads = (int(v) for v in spills.groups()) if spills else (0, 0, 0)
        kernels[kernel] = KernelResources(
            registers=int(registers.group(1)) if registers else 0,
            shared_bytes=int(shared.group(1)) if shared else 0,
            spill_store_bytes=stores,
            spill_load_bytes=loads,
            stack_bytes=stack,
        )
    return kernels


def _read_cache(path: Path, name: str, arch: str) -> CompiledSource | None:
    """The cached compile at path, or None when it is missing or does not parse (it is then rebuilt)."""
    try:
        blob = path.read_bytes()
        assert blob.startswith(_CACHE_MAGIC)
        header_len = int.from_bytes(blob[len(_CACHE_MAGIC) : len(_CACHE_MAGIC) + 8], "little")
        start = len(_CACHE_MAGIC) + 8
        header = json.loads(blob[start : start + header_len])
        cubin = blob[start + header_len :]
        assert hashlib.sha256(cubin).hexdigest() == header["cubin_sha256"]
    except (OSError, AssertionError, ValueError, KeyError, UnicodeDecodeError):
        return None
    log = header["log"]
    return CompiledSource(name, arch, cubin, log, header["compile_ms"], parse_resources(log), cached=True)


def _write_cache(path: Path, compiled: CompiledSource) -> None:
    header = json.dumps({
        "log": compiled.log,
        "compile_ms": compiled.compile_ms,
        "cubin_sha256": hashlib.sha256(compiled.cubin).hexdigest(),
    }).encode()
    blob = _CACHE_MAGIC + len(header).to_bytes(8, "little") + header + compiled.cubin
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
