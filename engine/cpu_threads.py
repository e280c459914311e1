"""One thread count for everything that computes on the CPU: BLAS (OpenBLAS through threadpoolctl) and
the quantised-weight kernels (numba, engine/backends/cpu/gguf_row_kernels.py).

They run one after the other inside a step, never at once, so they share the same cores: a pipeline
stage given N threads uses N for its BLAS calls and N for its kernels (api/serve.blas_threads splits the
cores among stages).
"""
from __future__ import annotations

import os

# OpenBLAS's idle workers spin for 2^N cycles after each call before they sleep (N = 28 by default: ~0.1 s).
# Attention's BLAS products alternate with numba's parallel kernels many times a step; the spinning worker took
# one of the two cores from the kernel that followed. With 2^4 cycles, a 2K-token prefill of Qwen2.5-Coder-0.5B
# went from 99 to 151-160 tok/s in one process (the same as BLAS on one thread: 152), attention 7.1 -> 3.0 s and
# the integer products 13.0 -> 7.8 s (docs/BENCHMARKS.md). Read once, when OpenBLAS loads with numpy.
BLAS_THREAD_TIMEOUT = "4"


def stop_blas_spinning() -> None:
    """OpenBLAS's workers sleep as soon as a call ends (OPENBLAS_THREAD_TIMEOUT), unless the user set it.
    Only takes effect before numpy is first imported: engine/__init__.py calls it."""
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)


def limit_threads(num_threads: int):
    """Set both thread counts to num_threads (process-wide; every thread that calls a kernel applies it).

    Returns threadpoolctl's limiter: used as a context manager it restores the BLAS count on exit (the
    kernel count stays); unused, the limit stays in force.
    """
    from threadpoolctl import threadpool_limits

    from engine.backends.cpu.gguf_row_kernels import set_kernel_threads

    set_kernel_threads(num_threads)
    return threadpool_limits(limits=num_threads, user_api="blas")
