"""A linear (or embedding table) kept in its GGUF blocks on the CPU, and how a batch of rows meets it.

    T <= KERNEL_MAX_ROWS (decode, a few streams):   y = kernel(raw rows, x)      weights read once, quantised
    T >  KERNEL_MAX_ROWS (prefill chunks), weights repacked (adopt_repacked, integer activations):
                                                    y = int8_gemm: x quantised to int8 per block, integer
                                                        dot products on 32-row tiles of the repacked weights
    T >  KERNEL_MAX_ROWS, raw rows:                 for each tile of output rows:
                                                       scratch[:n] = dequantised tile   (reused float32 buffer)
                                                       y[:, tile] = x @ scratch[:n].T   (BLAS)

Decode is memory-bound, so reading 4.5-8.5 bits per weight instead of 32 is the point. A prefill chunk is
compute-bound: vpdpbusd does 64 multiply-adds an instruction where a float32 FMA does 16, and the
integer path ran 2.7-4x the dequantise + BLAS one on qwen2.5-coder-0.5b's shapes (docs/BENCHMARKS.md).
The scratch buffer is per thread (pipeline stages compute concurrently) and at most SCRATCH_FLOATS long.
"""
from __future__ import annotations

import threading

import numpy as np

from engine.backends.cpu import gguf_dequant as decode
from engine.backends.cpu.gguf_row_kernels import call_kernel, dequant_rows, gather_rows, matmul_rows
from engine.backends.cpu.int8_gemm import gemm_part, quantize_act
from engine.backends.cpu.repacked_rows import dequant_part, gather_part, matmul_part
from engine.backends.page_release import release_pages
from engine.quant_types import CPU_TYPES
from engine.quant_weights import LinearPart

# GGUF type -> the decoders' id for it; the types the CPU kernels compute on directly (engine/quant_types.py).
KERNEL_KINDS = {t: getattr(decode, t.name) for t in CPU_TYPES}
KERNEL_MAX_ROWS = 8  # up to this many rows the kernel beats dequantise + BLAS (docs/BENCHMARKS.md)
# One thread dequantises a tile, then BLAS uses them all: with both pools busy-waiting on shared cores a
# parallel dequantisation made 512-token prefill 15-30% slower than float32; serial, it is level (measured,
# 2 threads, load average 6-8; it is ~5% of a chunk's work).
DEQUANT_THREADS = 1
SCRATCH_FLOATS = 4 * 2**20  # 16 MiB per computing thread: every layer matrix of the models we ship in one tile
_scratch = threading.local()


class QuantLinear:
    """Raw rows of one or more parts stacked along the output dimension ([out, in] as a whole).

    Holds the parts' arrays as given (views of the memory-mapped file where no row permutation or fusion
    was needed), never a float32 copy. Immutable after construction.
    """

    def __init__(self, parts: list[LinearPart]):
        assert parts and all(p.in_dim == parts[0].in_dim for p in parts), [p.name for p in parts]
        unsupported = [p.name for p in parts if p.tensor_type not in KERNEL_KINDS]
        assert not unsupported, f"no CPU kernel for {unsupported}: the loader converts those first"
        self.parts = [(KERNEL_KINDS[p.tensor_type], _readonly(p.rows), p.out_dim) for p in parts]
        self.in_dim = parts[0].in_dim
        self.out_dim = sum(p.out_dim for p in parts)
        self.names = [p.name for p in parts]
        self.repacked: list | None = None  # adopt_repacked: Int8Parts that replace the raw rows
        self.act_qmax = 32767.0  # adopt_repacked: how prefill products quantise their activations

    def adopt_repacked(self, parts: list, act_qmax: float = 32767.0) -> list[np.memmap]:
        """Compute on `parts` (int8_repack.Int8Part, one per raw part, the same rows) from now on and let
        the raw rows go (copies of fused or permuted rows are freed with them). Returns the file mappings the
        raw rows were views of: the caller hands their pages back once every linear adopted
        (release_mappings), since the loader's copies were read from those pages too. `parts` then serve
        matmul, gather and dequantize (cpu/repacked_rows.py); products of more than KERNEL_MAX_ROWS rows
        quantise the activations to act_qmax (127: int8, 32767: int16; cpu/int8_gemm.py), as the decode
        products of the same backend do."""
        assert len(parts) == len(self.parts), self.names
        roots = [root for _, rows, _ in self.parts if (root := mapping_root(rows)) is not None]
        self.repacked = [(part, out_dim) for part, (_, _, out_dim) in zip(parts, self.parts)]
        self.act_qmax = float(act_qmax)
        self.parts = [(kind, _NO_ROWS, out_dim) for kind, _, out_dim in self.parts]
        return roots

    @property
    def nbytes(self) -> int:
        if self.repacked is not None:
            # the distinct arrays of each part (a symmetric type's m is its d)
            return sum(a.nbytes for part, _ in self.repacked for a in {id(a): a for a in part[1:5]}.values())
        return sum(rows.nbytes for _, rows, _ in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_dim, self.in_dim

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T for x float32 [T, in] -> [T, out] float32 (a new array)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty((x.shape[0], self.out_dim), dtype=np.float32)
        col = 0
        if self.repacked is not None:
            act = None if x.shape[0] <= KERNEL_MAX_ROWS else quantize_act(x, self.act_qmax)  # once for all parts
            for part, out_dim in self.repacked:
                if act is None:
                    call_kernel(matmul_part, tuple(part), x, y, col)
                else:
                    call_kernel(gemm_part, tuple(part), act, y, col)
                col += out_dim
            return y
        for kind, rows, out_dim in self.parts:
            if x.shape[0] <= KERNEL_MAX_ROWS:
                matmul_rows(kind, rows, x, y, col)
            else:
                self._matmul_tiled(kind, rows, x, y[:, col : col + out_dim])
            col += out_dim
        return y

    def _matmul_tiled(self, kind, rows: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """A raw part's product through dequantised float32 tiles and BLAS."""
        n_rows = rows.shape[0]
        tile_rows = max(1, SCRATCH_FLOATS // self.in_dim)
        scratch = _thread_scratch(min(tile_rows, n_rows) * self.in_dim)
        for start in range(0, n_rows, tile_rows):
            n = min(tile_rows, n_rows - start)
            w = scratch[: n * self.in_dim].reshape(n, self.in_dim)
            dequant_rows(kind, rows[start : start + n], w, threads=DEQUANT_THREADS)
            y[:, start : start + n] = x @ w.T  # y is a column range of the fused output: not contiguous

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` decoded to float32 [len(ids), in] (embedding lookup); one part only."""
        assert len(self.parts) == 1, f"an embedding table is one tensor, got {self.names}"
        kind, rows, _ = self.parts[0]
        out = np.empty((len(ids), self.in_dim), dtype=np.float32)
        if self.repacked is not None:
            call_kernel(gather_part, tuple(self.repacked[0][0]), np.asarray(ids, dtype=np.int64), out)
            return out
        gather_rows(kind, rows, np.asarray(ids, dtype=np.int64), out)
        return out

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 [out, in] (tests and tools; the forward pass never calls this)."""
        out = np.empty((self.out_dim, self.in_dim), dtype=np.float32)
        row = 0
        for part, out_dim in self.repacked or []:
            dequant_part(tuple(part), 0, out[row : row + out_dim])
            row += out_dim
        for kind, rows, out_dim in [] if self.repacked else self.parts:
            dequant_rows(kind, rows, out[row : row + out_dim])
            row += out_dim
        return out


_NO_ROWS = np.zeros((0, 1), np.uint8)  # a raw part's rows once they are let go (adopt_repacked)
_NO_ROWS.flags.writeable = False


def mapping_root(rows: np.ndarray) -> np.memmap | None:
    """The outermost np.memmap the array is a view of (the whole GGUF file), or None for a copy."""
    root, base = None, rows
    while base is not None:
        if isinstance(base, np.memmap):
            root = base
        base = getattr(base, "base", None)
    return root


def release_mappings(roots: list[np.memmap]) -> int:
    """Hand back the pages of each distinct file mapping (read-only: touched again, they re-read from the
    file); returns the bytes of the ranges released."""
    return sum(release_pages(root) for root in {id(r): r for r in roots}.values())


def _readonly(rows: np.ndarray) -> np.ndarray:
    """A read-only C-contiguous view (no copy when already contiguous). Memory-mapped rows are read-only and
    fused ones are not; numba compiles (and caches) one machine-code version per argument type, so making
    every one read-only halves the first start's compile time."""
    view = np.ascontiguousarray(rows).view()
    view.flags.writeable = False
    return view


def _thread_scratch(n_floats: int) -> np.ndarray:
    """This thread's float32 scratch buffer, grown (never shrunk) to at least n_floats."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n_floats:
        buf = _scratch.buf = np.empty(n_floats, dtype=np.float32)
    return buf
