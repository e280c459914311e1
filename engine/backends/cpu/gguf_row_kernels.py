"""Compiled CPU kernels on raw GGUF rows (numba): few-row products, dequantisation, embedding lookup.

Why numba: wheels for Linux, Windows and macOS (no compiler on the user's machine, unlike a C
extension), LLVM auto-vectorises the decoders' fixed-width loops for the CPU it runs on (AVX-512 here,
NEON on Apple), `prange` spreads output rows over threads, and `cache=True` keeps the machine code on
disk next to this file (__pycache__), so only the first start after an install or an edit compiles.

Threads: numba's thread count is per calling thread (a pipeline stage's worker sets its own), so every
call goes through `_apply_threads`, which applies the count `set_kernel_threads` chose. The threading layer
must be thread-safe because pipeline stages call kernels from several threads at once: OpenMP (libgomp,
on every Linux) or TBB; without either, calls are serialised by a lock on numba's workqueue.
"""
from __future__ import annotations

import contextlib
import os
import threading

# Idle OpenMP threads sleep instead of spinning. The kernels and OpenBLAS take turns on the same cores, and
# the machines we run on are shared: libgomp's default spin (up to ~ms after every parallel region) stole
# the cores from the BLAS call that followed, and 2-thread decode fell 5-10x (SmolLM2: 7 vs 69 tok/s at
# batch 4, measured). Read by libgomp when numba loads it, i.e. after this import; a user's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # noqa: E402
import numpy as np
from numba import njit, prange  # noqa: E402

from engine.backends.cpu.gguf_dequant import decode_row, f16_table  # noqa: E402
from engine.backends.cpu.numba_cache_deps import key_on_sources  # noqa: E402

# Decoders: f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k mxfp4 (cpu/gguf_dequant.py, whose source
# keys this module's numba cache entries too: key_on_sources at the end).

numba.config.THREADING_LAYER = "threadsafe"
# reassoc lets LLVM split a dot product over SIMD lanes; contract allows FMA. No nnan/ninf: a NaN in the
# activations must stay visible.
_FASTMATH = {"reassoc", "contract", "nsz"}
_ROWS_PER_TASK = 16  # output rows decoded per parallel task (one row buffer allocation per task)
_F16_TABLE = f16_table()
# 16, passed at run time: with a constant trip count LLVM unrolls the decoders' inner loops and then
# vectorises the loop over blocks with gathers, 3x slower (measured).
_LANES = 16
_state = {"threads": None, "lock": None}


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _matmul_rows(kind, rows, x, y, col0, table, lanes):
    """y[:, col0 + r] = x @ row r, for every raw row r of `rows` ([out, row_bytes]); x [T, in] float32."""
    n_rows, (n_tok, in_dim) = rows.shape[0], x.shape
    for task in prange((n_rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        w = np.empty(in_dim, np.float32)
        w_bits = w.view(np.uint32)
        for r in range(task * _ROWS_PER_TASK, min(n_rows, (task + 1) * _ROWS_PER_TASK)):
            decode_row(kind, rows[r], w, table, w_bits, lanes)
            for t in range(n_tok):
                acc = np.float32(0.0)
                for i in range(in_dim):
                    acc += w[i] * x[t, i]
                y[t, col0 + r] = acc


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _dequant_rows(kind, rows, out, table, lanes):
    """out[r] = row r decoded to float32; out is [rows, in] (a view of a reused scratch buffer)."""
    for r in prange(rows.shape[0]):
        decode_row(kind, rows[r], out[r], table, out[r].view(np.uint32), lanes)


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _gather_rows(kind, rows, ids, out, table, lanes):
    """out[t] = row ids[t] decoded (the embedding lookup: only the rows asked for are decoded)."""
    for t in prange(ids.shape[0]):
        decode_row(kind, rows[ids[t]], out[t], table, out[t].view(np.uint32), lanes)


@njit(cache=True, fastmath=_FASTMATH)
def _gather_rows_serial(kind, rows, ids, out, table, lanes):
    """_gather_rows on the calling thread: a decode step's few rows."""
    for t in range(ids.shape[0]):
        decode_row(kind, rows[ids[t]], out[t], table, out[t].view(np.uint32), lanes)


# A decode step embeds one token a sequence; waking the sleeping OpenMP workers for that (OMP_WAIT_POLICY
# PASSIVE) cost 1.3 ms of a 54 ms Qwen2.5-Coder-0.5B decode step on a loaded 2-core machine, decoding one
# 896-wide row on the calling thread takes microseconds.
SERIAL_GATHER_ROWS = 8


def set_kernel_threads(num_threads: int | None) -> None:
    """Threads every later kernel call uses (None: all numba threads). Mutates process-wide state."""
    limit = numba.config.NUMBA_NUM_THREADS
    _state["threads"] = None if num_threads is None else max(1, min(int(num_threads), limit))


def kernel_threads() -> int:
    return _state["threads"] or numba.config.NUMBA_NUM_THREADS


def _apply_threads(wanted: int | None = None) -> None:
    _start_threading_layer()
    wanted = wanted or kernel_threads()
    if numba.get_num_threads() != wanted:
        numba.set_num_threads(wanted)


def _start_threading_layer() -> None:
    """Launch numba's thread pool once; fall back to workqueue (and a lock around calls) without OpenMP/TBB."""
    if _state["lock"] is not None:
        return
    try:
        numba.get_num_threads()  # launches the pool of the configured layer
    except ValueError:  # "No threading layer could be loaded"
        numba.config.THREADING_LAYER = "workqueue"
        numba.get_num_threads()
    safe = numba.threading_layer() != "workqueue"
    _state["lock"] = contextlib.nullcontext() if safe else threading.Lock()


def _call(kernel, *args, threads: int | None = None):
    _apply_threads(threads)
    with _state["lock"]:
        return kernel(*args)


def call_kernel(fn, *args):
    """fn(*args) under the kernel thread count and lock (for a jitted caller of several kernels, or Python
    code that calls them: the fused decode step); returns what fn returns."""
    return _call(fn, *args)


def matmul_rows(kind: int, rows: np.ndarray, x: np.ndarray, y: np.ndarray, col0: int = 0) -> None:
    """y[:, col0:col0 + len(rows)] = x @ decoded(rows).T, in place; x float32 C-contiguous [T, in]."""
    _call(_matmul_rows, kind, rows, x, y, col0, _F16_TABLE, _LANES)


def dequant_rows(kind: int, rows: np.ndarray, out: np.ndarray, threads: int | None = None) -> None:
    """out[:] = decoded(rows), float32 [len(rows), in], in place; `threads` overrides the kernel count."""
    _call(_dequant_rows, kind, rows, out, _F16_TABLE, _LANES, threads=threads)


def gather_rows(kind: int, rows: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """out[t] = decoded(rows[ids[t]]), in place; ids int64."""
    if ids.shape[0] <= SERIAL_GATHER_ROWS:
        _gather_rows_serial(kind, rows, ids, out, _F16_TABLE, _LANES)
    else:
        _call(_gather_rows, kind, rows, ids, out, _F16_TABLE, _LANES)


# numba caches each function against this file only; the jitted code and constants it calls in from
# these modules are compiled into its entries, so their sources key the cache too.
key_on_sources(globals(), ["engine.backends.cpu.gguf_dequant"])
