"""Let LLVM use the CPU's full vector width in the numba kernels (512-bit on AVX-512 machines).

LLVM tunes Intel AVX-512 CPUs to prefer 256-bit vectors (`prefer-256-bit`, a guard against the frequency
drops of early AVX-512 parts), and numba compiles for the host CPU with LLVM's defaults, so our kernels ran
in ymm registers. With the preference off they use zmm: the integer decode product 8.0 -> 8.9 Gweights/s
with the weights in cache and 4.9 -> 6.2 streaming 53 MB from memory (one thread, Sapphire Rapids class
Xeon, measured in session 6). numba reads NUMBA_CPU_FEATURES once, when it is imported, so this runs from
engine/__init__.py before any kernel module imports numba. A user's NUMBA_CPU_FEATURES or NUMBA_CPU_NAME
wins; on CPUs without AVX-512 the feature changes nothing.
"""
from __future__ import annotations

import os


def prefer_full_vector_width() -> None:
    """Set NUMBA_CPU_FEATURES to the host's features without prefer-256-bit (once, before numba loads)."""
    if "NUMBA_CPU_FEATURES" in os.environ or "NUMBA_CPU_NAME" in os.environ:
        return
    try:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        features = llvm.get_host_cpu_features()
    except Exception:  # noqa: BLE001 - an exotic host: numba's defaults, as before
        return
    if features.get("avx512f"):
        os.environ["NUMBA_CPU_FEATURES"] = features.flatten() + ",-prefer-256-bit"
