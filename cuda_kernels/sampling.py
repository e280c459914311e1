"""Launch geometry for sampling.cu, and the host twin of its random draw (Philox4x32-10)."""
from __future__ import annotations

from cuda_kernels.launch import unknown_kernel

SAMPLE_THREADS = 1024  # SAMPLE_THREADS in sampling.cu (its shared scan buffer is sized for it)

_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def mask_words(vocab: int) -> int:
    """Words in one row of sample_f32's allowed_mask (llguidance's bitmask: bit id % 32 of int32 word id / 32)."""
    return (vocab + 31) // 32


def geometry(kernel: str, **ints: int):
    """(grid, block, dynamic shared bytes) for sample_f32: one 1024-thread block per row."""
    if kernel != "sample_f32":
        raise unknown_kernel("sampling.cu", kernel)
    return (max(1, ints["rows"]), 1, 1), (SAMPLE_THREADS, 1, 1), 0


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 on one 128-bit counter under a 64-bit key (Random123's reference algorithm)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        product0, product1 = _PHILOX_M0 * c0, _PHILOX_M1 * c2
        hi0, lo0 = product0 >> 32, product0 & _MASK32
        hi1, lo1 = product1 >> 32, product1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: int, counter: int) -> float:
    """The uniform in [0, 1) that sample_f32 draws for (seed, counter): 24 bits of the first Philox word."""
    word = philox4x32_10((counter & _MASK32, 0, 0, 0), (seed & _MASK32, (seed >> 32) & _MASK32))[0]
    return (word >> 8) / float(1 << 24)
