"""Which kernels exist: every `cuda_kernels/*.cu` file and the `extern "C" __global__` kernels it defines.

Discovery instead of a hand-kept list, so a new source file (say quant_matvec.cu) is compiled, checked
and loadable the moment it is added. Launch geometry lives in a companion module next to each source
(`norms.cu` -> `cuda_kernels/norms.py`, `geometry(kernel, **ints) -> (grid, block, dynamic_shared_bytes)`),
called with the kernel's int arguments by their names in docs/CUDA_KERNELS.md.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
# extern "C" __global__ [__launch_bounds__(...)] void NAME(
_KERNEL_DECL = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r'(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\('
)

Grid = tuple[int, int, int]
Geometry = tuple[Grid, Grid, int]


def without_comments(source_text: str) -> str:
    """A CUDA source text with its // and /* */ comments removed (what the declarations are read from)."""
    return _COMMENTS.sub("", source_text)


def kernel_names(source_text: str) -> tuple[str, ...]:
    """Names of the extern "C" kernels declared in a source text, in order, comments ignored."""
    return tuple(_KERNEL_DECL.findall(without_comments(source_text)))


def discover_sources(directory: Path = KERNEL_DIR) -> dict[str, tuple[str, ...]]:
    """Source file name -> kernel names, for every .cu file in directory (sorted by name)."""
    return {path.name: kernel_names(path.read_text()) for path in sorted(directory.glob("*.cu"))}


SOURCES: dict[str, tuple[str, ...]] = discover_sources()
KERNELS: dict[str, str] = {kernel: source for source, kernels in SOURCES.items() for kernel in kernels}


def source_file_name(name: str) -> str:
    """`norms` or `norms.cu` -> `norms.cu`; ValueError naming the known sources otherwise."""
    file_name = name if name.endswith(".cu") else f"{name}.cu"
    if file_name not in SOURCES:
        raise ValueError(f"unknown kernel source {name!r}; known: {', '.join(SOURCES)}")
    return file_name


_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([\w.]+\.cuh)".*$', re.M)


def read_source(name: str) -> str:
    """A source's text as NVRTC and the CPU emulator compile it: `#include "x.cuh"` of a header in
    cuda_kernels/ is replaced by the header's text (NVRTC is given no include path; one expansion step
    here keeps the build, its cache key and the emulator on the same text)."""
    return expand_includes((KERNEL_DIR / source_file_name(name)).read_text())


def expand_includes(text: str, directory: Path = KERNEL_DIR, seen: tuple[str, ...] = ()) -> str:
    """Replace each local `#include "name.cuh"` by that header (recursively; a cycle is a ValueError)."""
    def insert(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:
            raise ValueError(f"#include cycle through {header}")
        path = directory / header
        if not path.is_file():
            raise ValueError(f'#include "{header}": no such header in {directory}')
        return f"// ---- {header} ----\n" + expand_includes(path.read_text(), directory, seen + (header,))
    return _LOCAL_INCLUDE.sub(insert, text)


def source_of(kernel: str) -> str:
    """The source file that defines a kernel."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}")
    return KERNELS[kernel]


def geometry(kernel: str, **ints: int) -> Geometry:
    """(grid, block, dynamic shared bytes) for launching `kernel`, from its companion module."""
    module = importlib.import_module(f"cuda_kernels.{Path(source_of(kernel)).stem}")
    return module.geometry(kernel, **ints)
