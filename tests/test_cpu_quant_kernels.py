"""The CPU kernels on raw GGUF rows against the gguf package's dequantisation (`gguf.quants.dequantize`).

Every type the kernels decode, on random blocks: written by gguf's own `quantize` where it has one, else
random bytes whose float16 scales are set to finite values of a realistic size (K-quants). Decoding must
equal gguf's floats exactly (same float32 operations); products may differ only by summation order.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.backends.cpu import quant_linear as cpu_quant_linear
from engine.backends.cpu.gguf_row_kernels import kernel_threads, set_kernel_threads
from engine.backends.cpu.quant_linear import KERNEL_KINDS, QuantLinear
from engine.quant_weights import LinearPart
from tests.support.quant_rows import ALL_TYPES, assert_product_close, random_rows, reference


def linear_of(tensor_type, out_dim=40, in_dim=512, seed=0):
    rows = random_rows(tensor_type, out_dim, in_dim, seed)
    part = LinearPart(tensor_type, rows, out_dim, in_dim, f"w{seed}")
    return QuantLinear([part]), reference(tensor_type, rows, out_dim, in_dim)


def test_every_listed_type_has_a_kernel():
    assert set(ALL_TYPES + [Q.BF16]) <= set(KERNEL_KINDS)


@pytest.mark.parametrize("tensor_type", ALL_TYPES, ids=lambda t: t.name)
def test_decoding_equals_gguf_dequantize_exactly(tensor_type):
    linear, expected = linear_of(tensor_type)
    np.testing.assert_array_equal(linear.dequantize(), expected)


@pytest.mark.parametrize("n_rows", [1, 3, 8])
@pytest.mark.parametrize("tensor_type", ALL_TYPES, ids=lambda t: t.name)
def test_few_row_product_on_raw_rows_matches_the_dequantised_product(tensor_type, n_rows):
    linear, w = linear_of(tensor_type)
    x = np.random.default_rng(1).standard_normal((n_rows, w.shape[1])).astype(np.float32)
    assert_product_close(linear.matmul(x), x, w)


@pytest.mark.parametrize("tensor_type", [Q.Q4_1, Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
def test_many_rows_dequantise_tiles_into_scratch_and_match(tensor_type, monkeypatch):
    monkeypatch.setattr(cpu_quant_linear, "SCRATCH_FLOATS", 512 * 7)  # tiles of 7 rows: 40 = 5 * 7 + 5
    linear, w = linear_of(tensor_type)
    x = np.random.default_rng(2).standard_normal((33, w.shape[1])).astype(np.float32)
    assert_product_close(linear.matmul(x), x, w)


def test_fused_parts_of_different_types_fill_their_column_ranges():
    parts, dense = [], []
    for seed, (tensor_type, out_dim) in enumerate([(Q.Q4_K, 16), (Q.Q8_0, 24), (Q.Q5_0, 8)]):
        rows = random_rows(tensor_type, out_dim, 256, seed)
        parts.append(LinearPart(tensor_type, rows, out_dim, 256))
        dense.append(reference(tensor_type, rows, out_dim, 256))
    linear, w = QuantLinear(parts), np.concatenate(dense)
    for n_rows in (1, 20):
        x = np.random.default_rng(n_rows).standard_normal((n_rows, 256)).astype(np.float32)
        assert_product_close(linear.matmul(x), x, w)


def test_gather_decodes_exactly_the_asked_rows():
    linear, w = linear_of(Q.Q8_0)
    ids = np.array([5, 0, 5, 39])
    np.testing.assert_array_equal(linear.gather(ids), w[ids])


def test_raw_rows_of_a_memory_mapped_tensor_are_kept_without_a_copy():
    rows = random_rows(Q.Q4_0, 8, 64)
    linear = QuantLinear([LinearPart(Q.Q4_0, rows, 8, 64)])
    assert np.shares_memory(linear.parts[0][1], rows) and linear.nbytes == rows.nbytes


def test_kernel_thread_count_is_clamped_and_applied():
    before = kernel_threads()
    try:
        set_kernel_threads(1)
        linear, w = linear_of(Q.Q4_0)
        x = np.ones((1, 512), np.float32)
        assert_product_close(linear.matmul(x), x, w)
        import numba

        assert kernel_threads() == 1 and numba.get_num_threads() == 1
        set_kernel_threads(10**6)
        assert kernel_threads() == numba.config.NUMBA_NUM_THREADS
    finally:
        set_kernel_threads(before)
