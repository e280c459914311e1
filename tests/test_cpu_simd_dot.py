"""The vector-IR row products (engine/backends/cpu/simd_dot.py), both lowerings: x86's vpmaddwd and plain IR.

- exact: unit scales, no mins, small activations, so every float32 partial sum is an integer below 2^24 and
  the result must equal numpy's int64 dot product exactly, for every layout, group count (odd counts take the
  tail path) and scale type;
- scaled: real scales and mins against a float64 reference of the same formula, within float32 rounding;
- the two lowerings give bit-identical results (the integer sums are exact either way, the float order is
  the same IR);
- a symmetric type's mins as d times a power-of-two factor give the stored mins' results bit for bit.
"""
import numpy as np
import pytest
from numba import njit

from engine.backends.cpu.simd_dot import MAX_TOKENS, row_dots, simd_enabled

LOWERINGS = [pytest.param(False, id="plain-ir"),
             pytest.param(True, id="avx2", marks=pytest.mark.skipif(not simd_enabled(), reason="no AVX2"))]
_compiled = {}


def _kernels(x86):
    """njit wrappers over every row and token of one lowering, `per_call` tokens a call (compiled once)."""
    if x86 in _compiled:
        return _compiled[x86]
    u4, u5, u8_32, u8_16 = row_dots(x86)

    @njit
    def rows_u4(qs, qh, d, m, mf, xlo, xhi, dx, sx, y, per_call):
        for r in range(qs.shape[0]):
            for t in range(0, xlo.shape[0], per_call):
                u4(qs, qh, d, m, mf, xlo, xhi, dx, sx, r, t, min(per_call, xlo.shape[0] - t), y, r)

    @njit
    def rows_u5(qs, qh, d, m, mf, xlo, xhi, dx, sx, y, per_call):
        for r in range(qs.shape[0]):
            for t in range(0, xlo.shape[0], per_call):
                u5(qs, qh, d, m, mf, xlo, xhi, dx, sx, r, t, min(per_call, xlo.shape[0] - t), y, r)

    @njit
    def rows_u8_32(qs, qh, d, m, mf, x16, dx, sx, y, per_call):
        for r in range(qs.shape[0]):
            for t in range(0, x16.shape[0], per_call):
                u8_32(qs, qh, d, m, mf, x16, dx, sx, r, t, min(per_call, x16.shape[0] - t), y, r)

    @njit
    def rows_u8_16(qs, qh, d, m, mf, x16, dx, sx, y, per_call):
        for r in range(qs.shape[0]):
            for t in range(0, x16.shape[0], per_call):
                u8_16(qs, qh, d, m, mf, x16, dx, sx, r, t, min(per_call, x16.shape[0] - t), y, r)

    _compiled[x86] = {"u4": rows_u4, "u5": rows_u5, "u8g32": rows_u8_32, "u8g16": rows_u8_16}
    return _compiled[x86]


def _case(layout, n_groups, rows=5, tokens=3, seed=0, small=True):
    """Random weights (U4 / U5 nibbles and fifth bits, or U8 bytes) and int16 activations; returns
    (qs, qh, w, x, group) with w [R, in] the integer weights in the kernels' order and x [T, in] the
    activations in the same order (qh [R, 0] but for U5)."""
    rng = np.random.default_rng(seed)
    group = 16 if layout == "u8g16" else 32
    n_in = n_groups * group
    x = rng.integers(-100 if small else -32767, 101 if small else 32768, (tokens, n_in)).astype(np.int16)
    qh = np.zeros((rows, 0), np.uint32)
    if layout in ("u4", "u5"):
        w = rng.integers(0, 16 if layout == "u4" else 32, (rows, n_in)).astype(np.uint8)
        blocks = w.reshape(rows, n_groups, 32)
        qs = ((blocks[..., :16] & 15) | ((blocks[..., 16:] & 15) << 4)).reshape(rows, -1).astype(np.uint8)
        if layout == "u5":
            bits = (blocks >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)
            qh = np.bitwise_or.reduce(bits, axis=-1).astype(np.uint32)
    else:
        w = rng.integers(0, 256, (rows, n_in)).astype(np.uint8)
        qs = w.copy()
    return qs, qh, w, x, group


def _run(x86, layout, qs, qh, x, d, m, dx, sx, per_call=MAX_TOKENS, m_factor=1.0):
    y = np.full((x.shape[0], qs.shape[0]), np.nan, np.float32)
    mf = np.float32(m_factor)
    if layout in ("u4", "u5"):
        xb = x.reshape(x.shape[0], -1, 32)
        xlo = np.ascontiguousarray(xb[..., :16].reshape(x.shape[0], -1))
        xhi = np.ascontiguousarray(xb[..., 16:].reshape(x.shape[0], -1))
        _kernels(x86)[layout](qs, qh, d, m, mf, xlo, xhi, dx, sx, y, per_call)
    else:
        _kernels(x86)[layout](qs, qh, d, m, mf, x, dx, sx, y, per_call)
    return y


def _scales(half, values):
    return values.astype(np.float16).view(np.uint16) if half else values.astype(np.float32)


@pytest.mark.parametrize("x86", LOWERINGS)
@pytest.mark.parametrize("half", [False, True], ids=["f32-scales", "f16-scales"])
@pytest.mark.parametrize("layout", ["u4", "u5", "u8g32", "u8g16"])
@pytest.mark.parametrize("n_groups", [1, 2, 3, 4, 5, 6, 7, 18])
def test_unit_scales_give_the_exact_integer_dot_product(x86, half, layout, n_groups):
    qs, qh, w, x, group = _case(layout, n_groups, tokens=6)
    rows, tokens = w.shape[0], x.shape[0]
    d = _scales(half, np.ones((rows, n_groups)))
    m = _scales(half, np.zeros((rows, n_groups)))
    dx, sx = np.ones((tokens, n_groups), np.float32), np.zeros((tokens, n_groups), np.float32)
    y = _run(x86, layout, qs, qh, x, d, m, dx, sx)
    np.testing.assert_array_equal(y, (x.astype(np.int64) @ w.astype(np.int64).T).astype(np.float32))


@pytest.mark.parametrize("x86", LOWERINGS)
@pytest.mark.parametrize("layout", ["u4", "u5", "u8g32", "u8g16"])
@pytest.mark.parametrize("n_groups", [5, 20])
def test_scales_and_mins_match_the_float64_formula(x86, layout, n_groups):
    qs, qh, w, x, group = _case(layout, n_groups, rows=7, tokens=4, seed=3, small=False)
    rng = np.random.default_rng(4)
    d = rng.uniform(0.001, 0.05, (7, n_groups)).astype(np.float32)
    m = rng.uniform(-0.5, 0.5, (7, n_groups)).astype(np.float32)
    dx = rng.uniform(1e-5, 1e-3, (4, n_groups)).astype(np.float32)
    sx = rng.uniform(-1.0, 1.0, (4, n_groups)).astype(np.float32)
    y = _run(x86, layout, qs, qh, x, d, m, dx, sx)
    sums = np.einsum("tgj,rgj->trg", x.reshape(4, n_groups, group).astype(np.float64),
                     w.reshape(7, n_groups, group).astype(np.float64))
    terms = sums * (d[None].astype(np.float64) * dx[:, None]) + m[None] * sx[:, None].astype(np.float64)
    ref = terms.sum(-1)
    bound = 1e-6 * np.abs(terms).sum(-1) + 1e-6
    assert np.all(np.abs(y - ref) <= bound), np.max(np.abs(y - ref) - bound)


@pytest.mark.skipif(not simd_enabled(), reason="no AVX2")
@pytest.mark.parametrize("layout", ["u4", "u5", "u8g32", "u8g16"])
def test_both_lowerings_are_bit_identical(layout):
    qs, qh, w, x, group = _case(layout, 9, rows=6, tokens=2, seed=5, small=False)
    rng = np.random.default_rng(6)
    d, m = (rng.uniform(-0.1, 0.1, (6, 9)).astype(np.float32) for _ in range(2))
    dx, sx = (rng.uniform(-0.01, 0.01, (2, 9)).astype(np.float32) for _ in range(2))
    np.testing.assert_array_equal(_run(True, layout, qs, qh, x, d, m, dx, sx), _run(False, layout, qs, qh, x, d, m, dx, sx))


@pytest.mark.parametrize("x86", LOWERINGS)
@pytest.mark.parametrize("layout", ["u4", "u5", "u8g32", "u8g16"])
def test_a_tokens_result_does_not_depend_on_the_tokens_computed_with_it(x86, layout):
    """Batch invariance: 7 tokens 1, 2, 3 and 4 a call give bit-identical rows."""
    qs, qh, w, x, group = _case(layout, 11, rows=4, tokens=7, seed=8, small=False)
    rng = np.random.default_rng(9)
    d, m = (rng.uniform(-0.1, 0.1, (4, 11)).astype(np.float32) for _ in range(2))
    dx, sx = (rng.uniform(-0.01, 0.01, (7, 11)).astype(np.float32) for _ in range(2))
    alone = _run(x86, layout, qs, qh, x, d, m, dx, sx, per_call=1)
    assert np.all(np.isfinite(alone))
    for per_call in range(2, MAX_TOKENS + 1):
        np.testing.assert_array_equal(_run(x86, layout, qs, qh, x, d, m, dx, sx, per_call=per_call), alone)


@pytest.mark.parametrize("x86", LOWERINGS)
@pytest.mark.parametrize("half", [False, True], ids=["f32-scales", "f16-scales"])
@pytest.mark.parametrize("layout, factor", [("u4", -8.0), ("u5", -16.0), ("u8g32", -128.0), ("u8g16", -32.0)])
def test_a_min_factor_on_d_gives_the_stored_mins_products_bit_for_bit(x86, half, layout, factor):
    """A symmetric type's parts pass d as m with m_factor (int8_repack): the same float32 results as mins
    factor * d stored (power-of-two factors are exact)."""
    qs, qh, w, x, group = _case(layout, 13, rows=6, tokens=5, seed=10, small=False)
    rng = np.random.default_rng(11)
    d_values = rng.uniform(-0.05, 0.05, (6, 13)).astype(np.float16).astype(np.float32)
    d, mins = _scales(half, d_values), _scales(half, d_values * np.float32(factor))  # both exact in float16
    dx, sx = (rng.uniform(-0.01, 0.01, (5, 13)).astype(np.float32) for _ in range(2))
    as_stored = _run(x86, layout, qs, qh, x, d, mins, dx, sx)
    factored = _run(x86, layout, qs, qh, x, d, d, dx, sx, m_factor=factor)
    assert np.all(np.isfinite(factored))
    np.testing.assert_array_equal(factored, as_stored)


def test_the_intrinsics_refuse_strided_arrays():
    u4, _, _, _ = row_dots(False)

    @njit
    def call(qs, qh, d, y):
        u4(qs, qh, d, d, np.float32(1.0), qs, qs, d, d, 0, 0, 1, y, 0)

    with pytest.raises(Exception, match="C-contiguous"):
        call(np.zeros((2, 32), np.int16)[:, ::2], np.zeros((2, 1), np.uint32), np.zeros((2, 1), np.float32),
             np.zeros((1, 2), np.float32))
