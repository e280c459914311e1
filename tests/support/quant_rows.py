"""Random GGUF weight rows of every type the CPU kernels read, their float32 reference (gguf's own
dequantisation) and the bounds the products are checked within: shared by the CPU kernel tests
(tests/test_cpu_*.py) and scripts/bench_decode_kernels.py."""
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16, Q.MXFP4]
# Byte offsets of the float16 scales inside a block, for types gguf cannot quantize.
RANDOM_BLOCK_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
ALL_TYPES = QUANTIZABLE + list(RANDOM_BLOCK_SCALES) + [Q.F16, Q.F32]


def random_rows(tensor_type, out_dim: int, in_dim: int, seed: int = 0) -> np.ndarray:
    """uint8 [out_dim, row_bytes] of valid blocks of `tensor_type`."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((out_dim, in_dim)).astype(np.float32)
    if tensor_type in QUANTIZABLE:
        return quantize(values, tensor_type)
    if tensor_type in (Q.F16, Q.F32):
        return values.astype(np.float16 if tensor_type == Q.F16 else np.float32).view(np.uint8)
    block_elems, block_bytes = GGML_QUANT_SIZES[tensor_type]
    rows = rng.integers(0, 256, (out_dim, in_dim // block_elems * block_bytes), dtype=np.uint8)
    blocks = rows.reshape(out_dim, -1, block_bytes)
    for offset in RANDOM_BLOCK_SCALES[tensor_type]:
        scales = (rng.standard_normal(blocks.shape[:2]) * 0.02).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return rows


def reference(tensor_type, rows: np.ndarray, out_dim: int, in_dim: int) -> np.ndarray:
    """float32 [out_dim, in_dim] of the rows, as gguf dequantises them."""
    if tensor_type == Q.F32:
        return rows.view(np.float32).reshape(out_dim, in_dim)
    if tensor_type == Q.F16:
        return rows.view(np.float16).astype(np.float32).reshape(out_dim, in_dim)
    return dequantize(rows, tensor_type).astype(np.float32).reshape(out_dim, in_dim)


def assert_product_close(y, x, w):
    # float32 sums of 512 terms in another order: error ~ sqrt(n) * eps * sum |x w|
    bound = 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6
    assert np.all(np.abs(y - x @ w.T) <= bound)


def quantized_x(x: np.ndarray, qmax) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(xq [T, in] int, dx [T, in/32], dx per element [T, in]): ggml's q8 rule (qmax 127), rounding half
    away from 0."""
    blocks = x.reshape(x.shape[0], -1, 32)
    dx = np.abs(blocks).max(-1) / qmax
    inv = np.divide(np.float32(1.0), dx, out=np.zeros_like(dx), where=dx > 0)
    v = blocks * inv[..., None]
    xq = np.where(v >= 0, np.floor(v + np.float32(0.5)), -np.floor(np.float32(0.5) - v)).astype(np.int64)
    return xq.reshape(x.shape), dx, np.repeat(dx, 32, axis=1)


def random_activations(n_tokens, in_dim, seed=1):
    """float32 [n_tokens, in_dim] with one all-zero block (its scale is 0)."""
    x = np.random.default_rng(seed).standard_normal((n_tokens, in_dim)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero block: scale 0, no division by it
    return x


def assert_close_both_ways(y, x, w, qmax):
    """y = x @ w.T of int-quantised activations: tight against x quantised the same way in numpy, and within
    the activation rounding against the float32 x (the derivation is in tests/test_cpu_int8_matvec.py)."""
    xq, _, dx_el = quantized_x(x, qmax)
    xd = (xq * dx_el).astype(np.float32)
    tight = 1e-5 * (np.abs(xd) @ np.abs(w).T) + 1e-6
    assert np.all(np.abs(y - xd @ w.T) <= tight), np.max(np.abs(y - xd @ w.T) - tight)
    derived = (dx_el / 2) @ np.abs(w).T + 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6
    assert np.all(np.abs(y - x @ w.T) <= derived)
