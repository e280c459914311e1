"""The prefill products on integers (engine/backends/cpu/int8_gemm.py, cpu/vnni_tile.py).

Every repacked type against the gguf package's dequantisation, as the decode products' tests do:
- tight: against dequantised W times x quantised the same way in numpy (only float32 summation order differs:
  the integer sums per group are exact);
- derived: against W times the float32 x, within the activation rounding dx / 2 per value.
Row counts that are not a multiple of the 32-row tile, token counts that are not a multiple of 4, float16
scales, and the vpdpbusd path against the plain vector IR one (the same integer sums).
"""
import numpy as np
import pytest
from numba import njit

from engine.backends.cpu.int8_gemm import gemm_part, quantize_act, tile_buffer, unpack_tile
from engine.backends.cpu.int8_repack import INT8_TYPES, repack
from engine.backends.cpu.vnni_tile import tile_kernel, vnni_enabled
from tests.support.quant_rows import (
    assert_close_both_ways, quantized_x, random_activations, random_rows, reference,
)

_Q8, _Q16 = np.float32(127.0), np.float32(32767.0)
QMAX = [_Q8, _Q16]


def quantize_act8(x):
    return quantize_act(x, _Q8)


def _gemm(tensor_type, n_rows, in_dim, x, half_scales=False, qmax=_Q8):
    part = tuple(repack(tensor_type, random_rows(tensor_type, n_rows, in_dim), in_dim, half_scales))
    y = np.full((x.shape[0], n_rows + 3), np.nan, np.float32)
    gemm_part(part, quantize_act(x, qmax), y, 2)  # a column range of a wider output, as fused parts are
    assert np.all(np.isnan(y[:, :2])) and np.all(np.isnan(y[:, -1]))
    return y[:, 2:-1]


@pytest.mark.parametrize("qmax", QMAX, ids=["int8", "int16"])
@pytest.mark.parametrize("tensor_type", INT8_TYPES, ids=lambda t: t.name)
def test_tiled_integer_product_matches_gguf_dequantisation(tensor_type, qmax):
    n_rows, in_dim = 45, 512  # one full tile and one of 13 rows
    x = random_activations(11, in_dim)  # 11 tokens: two calls of 4 and one of 3
    y = _gemm(tensor_type, n_rows, in_dim, x, qmax=qmax)
    w = reference(tensor_type, random_rows(tensor_type, n_rows, in_dim), n_rows, in_dim)
    assert_close_both_ways(y, x, w, qmax)


@pytest.mark.parametrize("tensor_type", [t for t in INT8_TYPES if t.name in ("Q4_0", "Q8_0")], ids=lambda t: t.name)
def test_float16_scales_give_the_same_products(tensor_type):
    x = random_activations(9, 256, seed=3)
    np.testing.assert_array_equal(_gemm(tensor_type, 40, 256, x, half_scales=True), _gemm(tensor_type, 40, 256, x))


@pytest.mark.parametrize("qmax", QMAX, ids=["int8", "int16"])
def test_activation_quantisation_is_the_decode_products_rule(qmax):
    x = random_activations(3, 256)
    x[1, :32] = np.linspace(-2.0, 2.0, 32)
    x8, dx32, sx32, dx16, sx16 = quantize_act(x, qmax)
    assert x8.dtype == (np.int8 if qmax == _Q8 else np.int16)
    xq, dx_ref, _ = quantized_x(x, qmax)
    np.testing.assert_array_equal(x8, xq)
    np.testing.assert_array_equal(dx32, dx_ref)
    np.testing.assert_array_equal(dx16, np.repeat(dx_ref, 2, axis=1))
    np.testing.assert_allclose(sx32, dx_ref * xq.reshape(3, -1, 32).sum(-1), rtol=1e-6)
    np.testing.assert_allclose(sx16, np.repeat(dx_ref, 2, axis=1) * xq.reshape(3, -1, 16).sum(-1), rtol=1e-6)
    assert x8[1, 0] == -int(qmax) and x8[1, 31] == int(qmax) and np.all(x8[0, 32:64] == 0)


def test_non_finite_activation_makes_its_token_nan_only():
    x = random_activations(5, 256)
    x[2, 40] = np.inf
    y = _gemm(INT8_TYPES[0], 33, 256, x)
    assert np.all(np.isnan(y[2])) and np.all(np.isfinite(np.delete(y, 2, axis=0)))


_dot_ir = tile_kernel(vnni=False)
_dot_vnni = tile_kernel(vnni=True)


@njit
def _tile_with(which, part, act, y):
    wt = tile_buffer(act[0].shape[1] * 32, act[0])
    n_groups = part[3].shape[1]
    dt, mt = np.empty(n_groups * 32, np.float32), np.empty(n_groups * 32, np.float32)
    unpack_tile(part, 0, 32, wt, dt, mt, tile_buffer(act[0].shape[1] * 32, act[0]).reshape(32, act[0].shape[1]))
    x8, dx32, sx32, dx16, sx16 = act
    dx, sx = (dx16, sx16) if n_groups * 16 == x8.shape[1] else (dx32, sx32)
    for t in range(0, x8.shape[0], 4):
        count = min(4, x8.shape[0] - t)
        if which:
            _dot_vnni(wt, dt, mt, x8, dx, sx, t, count, y)
        else:
            _dot_ir(wt, dt, mt, x8, dx, sx, t, count, y)


@pytest.mark.skipif(not vnni_enabled(), reason="numba does not target AVX-512 VNNI here")
@pytest.mark.parametrize("qmax", QMAX, ids=["int8", "int16"])
@pytest.mark.parametrize("tensor_type", [t for t in INT8_TYPES if t.name in ("Q4_K", "Q6_K", "Q8_0")],
                         ids=lambda t: t.name)
def test_vnni_and_plain_vector_ir_agree(tensor_type, qmax):
    part = tuple(repack(tensor_type, random_rows(tensor_type, 32, 256), 256))
    act = quantize_act(random_activations(7, 256, seed=5), qmax)
    y_ir, y_vnni = np.empty((7, 32), np.float32), np.empty((7, 32), np.float32)
    _tile_with(False, part, act, y_ir)
    _tile_with(True, part, act, y_vnni)
    np.testing.assert_array_equal(y_vnni, y_ir)  # no fast-math: the same float operations too


@pytest.mark.parametrize("qmax", QMAX, ids=["int8", "int16"])
def test_a_tokens_row_does_not_depend_on_the_tokens_computed_with_it(qmax):
    part = tuple(repack(INT8_TYPES[0], random_rows(INT8_TYPES[0], 32, 256), 256))
    x = random_activations(7, 256, seed=9)
    y_all = np.empty((7, 32), np.float32)
    gemm_part(part, quantize_act(x, qmax), y_all, 0)
    for t in range(7):
        y_one = np.empty((1, 32), np.float32)
        gemm_part(part, quantize_act(x[t : t + 1], qmax), y_one, 0)
        np.testing.assert_array_equal(y_one[0], y_all[t])
