"""One thread count for everything that computes on the CPU: BLAS (OpenBLAS through threadpoolctl) and
the quantised-weight kernels (numba, engine/backends/cpu/gguf_row_kernels.py).

They run one after the other inside a step, never at once, so they share the same cores: a pipeline
stage given N threads uses N for its BLAS calls and N for its kernels (api/serve.blas_threads splits the
cores among stages).
"""
from __future__ import annotations


def limit_threads(num_threads: int):
    """Set both thread counts to num_threads (process-wide; every thread that calls a kernel applies it).

    Returns threadpoolctl's limiter: used as a context manager it restores the BLAS count on exit (the
    kernel count stays); unused, the limit stays in force.
    """
    from threadpoolctl import threadpool_limits

    from engine.backends.cpu.gguf_row_kernels import set_kernel_threads

    set_kernel_threads(num_threads)
    return threadpool_limits(limits=num_threads, user_api="blas")
