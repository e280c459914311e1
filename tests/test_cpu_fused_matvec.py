"""The fused decode step's products on raw rows (cpu.fused_matvec.matvec2) against gguf's dequantisation."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.backends.cpu.fused_matvec import block_sums, matvec2
from engine.backends.cpu.gguf_dequant import f16_table
from engine.backends.cpu.quant_linear import KERNEL_KINDS
from tests.support.quant_rows import ALL_TYPES, assert_product_close, random_rows, reference

_TABLE = f16_table()


def _product(parts, x):
    """matvec2 over one or two (type, rows) parts; the second may be absent."""
    (k0, r0), (k1, r1) = parts if len(parts) == 2 else (parts[0], (Q.F32, np.zeros((0, 4), np.uint8)))
    xs = np.empty((x.shape[0], x.shape[1] // 32), np.float32)
    block_sums(x, xs)
    y = np.full((x.shape[0], r0.shape[0] + r1.shape[0]), np.nan, np.float32)
    matvec2(KERNEL_KINDS[k0], r0, KERNEL_KINDS[k1], r1, x, xs, y, _TABLE, 16)
    return y


@pytest.mark.parametrize("tensor_type", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 4])
def test_matvec2_matches_dequantised_product(tensor_type, n_tokens):
    out_dim, in_dim = 37, 512  # 37: a partial last task of 16 rows
    rows = random_rows(tensor_type, out_dim, in_dim)
    x = np.random.default_rng(1).standard_normal((n_tokens, in_dim)).astype(np.float32)
    y = _product([(tensor_type, rows)], x)
    assert_product_close(y, x, reference(tensor_type, rows, out_dim, in_dim))


def test_matvec2_stacks_two_parts_of_different_types():
    in_dim = 256
    a, b = random_rows(Q.Q5_0, 20, in_dim, seed=2), random_rows(Q.Q8_0, 9, in_dim, seed=3)
    x = np.random.default_rng(4).standard_normal((3, in_dim)).astype(np.float32)
    w = np.concatenate([reference(Q.Q5_0, a, 20, in_dim), reference(Q.Q8_0, b, 9, in_dim)])
    assert_product_close(_product([(Q.Q5_0, a), (Q.Q8_0, b)], x), x, w)
