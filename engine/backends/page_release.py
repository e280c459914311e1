"""Giving the pages of an unused array range back to the OS (the elastic KV pool's shrink on numpy).

numpy's pools come from calloc, whose pages the kernel commits only when first touched; so a pool sized for
the most it may ever hold costs memory only for the blocks used. When the pool shrinks, the pages of the
ids above its new size are handed back with madvise(MADV_DONTNEED): they read as zeros if touched again,
which is fine for blocks that hold nothing. Elsewhere than Linux nothing is released (the memory stays
committed, as a fixed pool's would), and the caller is told so by the byte count.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import numpy as np

_MADV_DONTNEED, _MADV_NOHUGEPAGE = 4, 15
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None


def release_pages(view: np.ndarray) -> int:
    """Hand back the whole pages inside a C-contiguous view; returns the bytes released (0 if none)."""
    if _libc is None or view.nbytes == 0:
        return 0
    assert view.flags.c_contiguous, "only a contiguous range can be released"
    page = mmap.PAGESIZE
    start = view.ctypes.data
    first = -(-start // page) * page
    last = (start + view.nbytes) // page * page
    if last <= first:
        return 0
    if _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) != 0:
        return 0  # EINVAL on memory the kernel will not release: it stays, nothing is wrong
    return last - first


def avoid_huge_pages(array: np.ndarray) -> None:
    """Keep a large, sparsely touched array on 4 KiB pages (a hint; no-op elsewhere than Linux).

    numpy asks for transparent huge pages on every allocation of 4 MiB or more; the K/V pool is
    [layers, heads, slots, row], so a short prompt writes a few rows 1 MiB apart in every (layer, head)
    and, with 2 MiB pages, made the whole pool resident (SmolLM2, 4096 slots: 180 MiB after a 30-token
    prefill, 1 MiB without; measured with /proc/self/smaps)."""
    if _libc is None or array.nbytes == 0:
        return
    page = mmap.PAGESIZE
    first = array.ctypes.data // page * page
    _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(array.ctypes.data + array.nbytes - first), _MADV_NOHUGEPAGE)
