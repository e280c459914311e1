"""Runs the CUDA kernel sources on the CPU, for checking them against the numpy reference without a GPU.

Each .cu file is compiled by g++ together with tests/support/cuda_emulation/cuda_emulation.h (OS threads for CUDA
threads, barriers for __syncthreads and warp shuffles) into a shared library with one `emu_launch_<kernel>`
wrapper per kernel, called through ctypes with the geometry from the source's companion module. The
control flow, indexing, reductions and synchronisation are the kernel's own; the arithmetic is the host's
(no FMA contraction, glibc expf), so compare with a float32 tolerance. Blocks run one after another with
one OS thread per CUDA thread: keep the problems small.
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from cuda_kernels import registry
from engine.backends.cuda import abi as cuda_abi

SHIM = Path(__file__).parent / "cuda_emulation" / "cuda_emulation.h"
PTX_SHIM = Path(__file__).parent / "cuda_emulation" / "ptx_emulation.h"
_STATIC_SHARED = re.compile(r"^(\s*)__shared__\s+([^;]*);", re.M)
_ASM = re.compile(r"\basm\s*(?:volatile\s*)?\(")
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\[\];")
_POINTER_DTYPES = {"float": np.float32, "int": np.int32, "long long": np.int64,
                   "unsigned long long": np.uint64, "unsigned char": np.uint8,
                   "unsigned short": np.uint16, "signed char": np.int8}


def compiler_available() -> bool:
    return shutil.which("g++") is not None


def kernel_params(source_text: str, kernel: str) -> list[tuple[str, str]]:
    """(C type, name) of each kernel parameter, read from the source."""
    declaration = re.search(rf"\b{kernel}\s*\(([^)]*)\)", registry.without_comments(source_text)).group(1)
    params = []
    for part in declaration.split(","):
        ctype, name = part.strip().rsplit(None, 1)
        if name.startswith("*"):
            ctype, name = ctype + "*", name[1:]
        params.append((ctype.replace("const ", "").replace(" *", "*").strip(), name))
    return params


class EmulatedSource:
    """One .cu file built for the host; `launch(kernel, **args)` runs a kernel over numpy arrays in place."""

    def __init__(self, source: str, build_dir: Path):
        self.name = registry.source_file_name(source)
        text = registry.read_source(self.name)
        self.params = {k: kernel_params(text, k) for k in registry.SOURCES[self.name]}
        body = _EXTERN_SHARED.sub(r"\1* \2 = reinterpret_cast<\1*>(emu::dynamic_shared_base);", text)
        body = translate_asm(body)
        body = _STATIC_SHARED.sub(_garbage_shared, body)
        wrappers = [self._wrapper(k) for k in self.params]
        program = f'#include "{SHIM}"\n#include "{PTX_SHIM}"\n{body}\n' + "\n".join(wrappers)
        digest = hashlib.sha256((program + SHIM.read_text() + PTX_SHIM.read_text()).encode()).hexdigest()[:16]
        library = build_dir / f"{Path(self.name).stem}-{digest}.so"
        if not library.exists():
            cpp = library.with_suffix(".cpp")
            cpp.write_text(program)
            subprocess.run(
                ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                 "-o", str(library), str(cpp)],
                check=True, capture_output=True, text=True,
            )
        self.lib = ctypes.CDLL(str(library))

    def _wrapper(self, kernel: str) -> str:
        params = ", ".join(f"{ctype} {name}" for ctype, name in self.params[kernel])
        names = ", ".join(name for _, name in self.params[kernel])
        return (
            f'extern "C" void emu_launch_{kernel}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,'
            f" unsigned bz, unsigned long long shared, {params}) {{\n"
            f"    emu::launch(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, shared, [&] {{ {kernel}({names}); }});\n}}\n"
        )

    def launch(self, kernel: str, threads: int | None = None, **args) -> None:
        """Run `kernel` with arguments by name (arrays for pointers, Python numbers for scalars), with the
        geometry of its companion module; `threads` overrides the block size (for kernels that allow it)."""
        args = {cuda_abi.arg_name(k) if k == "in" else k: v for k, v in args.items()}  # C's `in` is `in_`
        ints = {cuda_abi.arg_name(n): int(args[cuda_abi.arg_name(n)]) for ctype, n in self.params[kernel]
                if ctype == "int"}
        grid, block, shared = registry.geometry(kernel, **ints)
        if threads is not None:
            block = (threads, 1, 1)
        c_args = [self._c_arg(kernel, ctype, name, args[cuda_abi.arg_name(name)])
                  for ctype, name in self.params[kernel]]
        self.launch_raw(kernel, grid, block, shared, c_args)

    def launch_raw(self, kernel: str, grid, block, shared: int, c_args: list) -> None:
        """Run `kernel` with an explicit launch shape and ctypes arguments in the kernel's own order."""
        getattr(self.lib, f"emu_launch_{kernel}")(
            *(ctypes.c_uint(v) for v in (*grid, *block)), ctypes.c_ulonglong(shared), *c_args
        )

    @staticmethod
    def _c_arg(kernel: str, ctype: str, name: str, value):
        if ctype.endswith("*"):
            if value is None:
                return ctypes.c_void_p(0)
            check_array(kernel, ctype, name, value)
            return ctypes.c_void_p(value.ctypes.data)
        return ctypes.c_int(int(value)) if ctype == "int" else ctypes.c_float(float(value))


def check_array(kernel: str, ctype: str, name: str, value) -> None:
    """A pointer argument must be a contiguous numpy array of the pointee's type."""
    expected = _POINTER_DTYPES[ctype[:-1].strip()]
    assert isinstance(value, np.ndarray) and value.dtype == expected and value.flags.c_contiguous, (
        f"{kernel}: {name} must be a contiguous {np.dtype(expected)} array"
    )


def translate_asm(text: str) -> str:
    """Rewrite every inline-PTX statement `asm [volatile]("instr ops;" : outputs : inputs);` into
    `ptx_<instr>(outputs..., inputs...);` (tests/support/cuda_emulation/ptx_emulation.h defines those). The template's
    %N must appear in operand order (so operand order is instruction order); anything else fails loudly."""
    out, pos = [], 0
    for match in _ASM.finditer(text):
        if match.start() < pos:
            continue
        end = _closing_paren(text, match.end() - 1)
        sections = _split_top(text[match.end():end], ":")
        template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', sections[0]))
        instruction = template.split()[0]
        numbers = [int(n) for n in re.findall(r"%(\d+)", template)]
        first_seen = list(dict.fromkeys(numbers))
        operands = [_operand(o) for section in sections[1:3] for o in _split_top(section, ",") if o.strip()]
        assert first_seen == list(range(len(operands))), f"asm operands out of order in {template!r}"
        name = "ptx_" + re.sub(r"\W", "_", instruction)
        out += [text[pos:match.start()], f"{name}({', '.join(operands)})"]
        pos = end + 1
    return "".join(out) + text[pos:]


def _closing_paren(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced asm statement")


def _split_top(text: str, sep: str) -> list[str]:
    """Split on `sep` outside parentheses and string literals."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif not quoted:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if ch == sep and depth == 0:
                parts.append(text[start:i])
                start = i + 1
    return parts + [text[start:]]


def _operand(text: str) -> str:
    """'"+f"(c[0])' -> 'c[0]'."""
    return re.fullmatch(r'\s*"[^"]*"\s*\((.*)\)\s*', text, re.S).group(1).strip()


def _garbage_shared(match: re.Match) -> str:
    """`__shared__ float a[4], b[4];` -> the function-static arrays (blocks run one after another), filled with
    garbage by the first thread of each block that reaches them: a GPU block starts with undefined shared
    memory, not the previous block's values, so a read before a write shows up."""
    indent, declaration = match.groups()
    names = [re.findall(r"\w+", re.sub(r"__align__\(\d+\)", "", part).split("[")[0])[-1]
             for part in _declarators(declaration)]
    fills = " ".join(f"emu::garbage_once(&{name}, sizeof({name}));" for name in names)
    return f"{indent}static {declaration}; {fills}"


def _declarators(declaration: str) -> list[str]:
    """'float a[4], b[4]' -> ['float a[4]', ' b[4]'] (commas outside brackets)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(declaration):
        depth += {"[": 1, "]": -1, "(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(declaration[start:i])
            start = i + 1
    return parts + [declaration[start:]]
