"""The int8-activation products (engine/backends/cpu/int8_matvec.py) and the repacking they run on.

Every type against the gguf package's dequantisation, for int8 (qmax 127, ggml's q8 rule) and int16
(qmax 32767) activations, two ways:
- tight: against dequantised W times x quantised the same way in numpy (`quantized_x`), i.e. only float32
  summation order differs (the integer inner sums are exact);
- derived: against W times the float32 x, within the activation rounding |x_j - dx xq_j| <= dx / 2
  (dx = max|x_block| / qmax), so
  |error| <= sum_j dx(j) / 2 * |w_j| plus the summation-order term.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.backends.cpu import int8_repack as cpu_int8_repack
from engine.backends.cpu.int8_matvec import project_i8, quantize_act
from engine.backends.cpu.int8_repack import INT8_TYPES, empty_part, repack, unpack
from tests.support.quant_rows import assert_close_both_ways, quantized_x, random_activations, random_rows, reference

_EMPTY = tuple(empty_part())
QMAX = [np.float32(127.0), np.float32(32767.0)]
_ids = {127: "int8", 32767: "int16"}


def _qmax_id(qmax):
    return _ids[int(qmax)]


@pytest.mark.parametrize("tensor_type", INT8_TYPES, ids=lambda t: t.name)
def test_unpacked_integers_and_scales_rebuild_gguf_dequantisation_exactly(tensor_type):
    rows = random_rows(tensor_type, 9, 512)
    values, d, m, group = unpack(tensor_type, rows, 512)
    q = values.astype(np.float32) - (32 if tensor_type == Q.Q6_K else 0)
    w = (q.reshape(9, -1, group) * d[..., None]).reshape(9, 512)
    if m is not None:
        w = (w.reshape(9, -1, 32) + m[..., None]).reshape(9, 512)
    np.testing.assert_array_equal(w, reference(tensor_type, rows, 9, 512))


@pytest.mark.parametrize("qmax", QMAX, ids=_qmax_id)
def test_activation_quantisation_is_ggmls_q8_rule(qmax):
    x = random_activations(3, 256)
    x[1, :32] = np.linspace(-2.0, 2.0, 32)  # the block's extremes land exactly on +-127
    xlo, xhi, x16, dx, dx16, sx, sx16 = quantize_act(x, qmax)
    xq, dx_ref, _ = quantized_x(x, qmax)
    np.testing.assert_array_equal(x16, xq)
    np.testing.assert_array_equal(dx, dx_ref)
    np.testing.assert_array_equal(dx16, np.repeat(dx_ref, 2, axis=1))
    np.testing.assert_allclose(sx, dx_ref * xq.reshape(3, -1, 32).sum(-1), rtol=1e-6)
    np.testing.assert_allclose(sx16, np.repeat(dx_ref, 2, axis=1) * xq.reshape(3, -1, 16).sum(-1), rtol=1e-6)
    np.testing.assert_array_equal(np.concatenate([xlo.reshape(3, -1, 16), xhi.reshape(3, -1, 16)], -1),
                                  xq.reshape(3, -1, 32))
    assert x16[1, 0] == -int(qmax) and x16[1, 31] == int(qmax) and np.all(x16[0, 32:64] == 0)


@pytest.mark.parametrize("tensor_type", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 4])
@pytest.mark.parametrize("qmax", QMAX, ids=_qmax_id)
def test_int8_product_matches_the_dequantised_product(tensor_type, n_tokens, qmax):
    out_dim, in_dim = 37, 512  # 37: a partial last task of 16 rows
    rows = random_rows(tensor_type, out_dim, in_dim)
    x = random_activations(n_tokens, in_dim)
    y = project_i8(tuple(repack(tensor_type, rows, in_dim)), _EMPTY, x, qmax)
    assert_close_both_ways(y, x, reference(tensor_type, rows, out_dim, in_dim), qmax)


@pytest.mark.parametrize("qmax", QMAX, ids=_qmax_id)
def test_int8_product_stacks_two_parts_of_different_forms(qmax):
    in_dim = 256
    a, b = random_rows(Q.Q4_K, 20, in_dim, seed=2), random_rows(Q.Q6_K, 9, in_dim, seed=3)
    x = random_activations(3, in_dim, seed=4)
    y = project_i8(tuple(repack(Q.Q4_K, a, in_dim)), tuple(repack(Q.Q6_K, b, in_dim)), x, qmax)
    w = np.concatenate([reference(Q.Q4_K, a, 20, in_dim), reference(Q.Q6_K, b, 9, in_dim)])
    assert_close_both_ways(y, x, w, qmax)


@pytest.mark.parametrize("qmax", QMAX, ids=_qmax_id)
def test_each_token_is_computed_alone(qmax):
    """A batch's row t is bit-identical to token t on its own (per-token scales, the same loops)."""
    rows = random_rows(Q.Q4_1, 40, 256)
    part = tuple(repack(Q.Q4_1, rows, 256))
    x = random_activations(5, 256)
    together = project_i8(part, _EMPTY, x, qmax)
    for t in range(5):
        np.testing.assert_array_equal(together[t], project_i8(part, _EMPTY, x[t : t + 1].copy(), qmax)[0])


@pytest.mark.parametrize("tensor_type", [Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
def test_repacking_in_row_chunks_equals_repacking_at_once(tensor_type, monkeypatch):
    rows = random_rows(tensor_type, 37, 256)
    whole = repack(tensor_type, rows, 256)
    monkeypatch.setattr(cpu_int8_repack, "REPACK_ROWS", 16)  # 37 = 16 + 16 + 5
    chunked = repack(tensor_type, rows, 256)
    assert whole.form == chunked.form and (whole.m is whole.d) == (chunked.m is chunked.d)
    for a, b in zip(whole[1:], chunked[1:]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_activation_makes_the_product_nan(bad):
    """As on the float path: the rounding must not turn a NaN or an overflow into a finite number."""
    rows = random_rows(Q.Q4_1, 20, 256)
    x = random_activations(2, 256)
    x[1, 70] = bad
    y = project_i8(tuple(repack(Q.Q4_1, rows, 256)), _EMPTY, x, QMAX[1])
    assert np.all(np.isfinite(y[0])) and np.all(np.isnan(y[1]))


@pytest.mark.parametrize("tensor_type", cpu_int8_repack.HALF_SCALE_TYPES, ids=lambda t: t.name)
def test_float16_scales_give_the_float32_scales_product_bit_for_bit(tensor_type):
    """The types whose scales are float16 in the file repack them as float16 bits (2-4 bytes a group fewer);
    widened in the kernel they are the same float32 values, so the products are identical."""
    rows = random_rows(tensor_type, 37, 256)
    full, half = repack(tensor_type, rows, 256), repack(tensor_type, rows, 256, half_scales=True)
    assert half.d.dtype == np.uint16 and half.d.nbytes * 2 == full.d.nbytes
    np.testing.assert_array_equal(half.d.view(np.float16).astype(np.float32), full.d)
    np.testing.assert_array_equal(half.m.view(np.float16).astype(np.float32), full.m)
    x = random_activations(3, 256)
    for qmax in QMAX:
        np.testing.assert_array_equal(project_i8(tuple(half), tuple(empty_part(True)), x, qmax),
                                      project_i8(tuple(full), _EMPTY, x, qmax))


def test_k_quant_scales_are_refused_as_float16():
    with pytest.raises(ValueError, match="not float16"):
        repack(Q.Q4_K, random_rows(Q.Q4_K, 2, 256), 256, half_scales=True)


def test_a_symmetric_types_float16_mins_need_no_range_check():
    """q8_0's mins are -128 d: stored, a d of 1000 overflowed float16; as d times m_factor they cannot."""
    rows = random_rows(Q.Q8_0, 4, 256).copy()
    rows[2, :2] = np.array([1000.0], np.float16).view(np.uint8)
    full, half = repack(Q.Q8_0, rows, 256), repack(Q.Q8_0, rows, 256, half_scales=True)
    x = random_activations(2, 256)
    y = project_i8(tuple(half), tuple(empty_part(True)), x, QMAX[1])
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y, project_i8(tuple(full), _EMPTY, x, QMAX[1]))


# bytes a 32-weight group takes repacked, float32 / float16 scales (int8_repack's table)
_GROUP_BYTES = {Q.Q4_0: (20, 18), Q.Q4_1: (24, 20), Q.Q5_0: (24, 22), Q.Q5_1: (28, 24), Q.Q8_0: (36, 34),
                Q.Q4_K: (24, None), Q.Q5_K: (28, None), Q.Q6_K: (40, None)}


@pytest.mark.parametrize("tensor_type", INT8_TYPES, ids=lambda t: t.name)
def test_repacked_bytes_a_group_are_the_tables(tensor_type):
    """A symmetric type keeps no mins array (its m is d itself) and the 5-bit types keep their fifth bits
    as bits: the sizes int8_repack's docstring states, which the decode step streams every token."""
    rows = random_rows(tensor_type, 8, 256)
    symmetric = tensor_type in (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q6_K)
    for half, expected in zip((False, True), _GROUP_BYTES[tensor_type]):
        if expected is None:
            continue
        part = repack(tensor_type, rows, 256, half_scales=half)
        assert (part.m is part.d) == symmetric
        assert part.qh.shape[1] == (8 if tensor_type in (Q.Q5_0, Q.Q5_1, Q.Q5_K) else 0)
        arrays = {id(a): a for a in (part.qs, part.qh, part.d, part.m)}.values()
        assert sum(a.nbytes for a in arrays) == expected * 8 * 8, (half, part.form)
