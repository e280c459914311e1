"""float16 conversions in numba (engine/backends/cpu/half.py) against numpy, for every float16 value and for
float32 values around every float16 rounding boundary."""
import numpy as np
from numba import njit

from engine.backends.cpu.half import as_float, kv_store


@njit(cache=False)
def _widen(bits, out):
    for i in range(bits.size):
        out[i] = as_float(bits[i])


@njit(cache=False)
def _narrow(values, like, out):
    for i in range(values.size):
        out[i] = kv_store(values[i], like[0])


def test_every_float16_widens_exactly():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.empty(65536, np.float32)
    _widen(bits, out)
    expected = bits.view(np.float16).astype(np.float32)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(out[finite], expected[finite])
    assert np.isnan(out[np.isnan(expected)]).all()
    np.testing.assert_array_equal(out[np.isinf(expected)], expected[np.isinf(expected)])


def test_float32_narrows_as_numpy_does_ties_to_even():
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    halves = halves[np.isfinite(halves)]
    mid = (halves[:-1].astype(np.float64) + halves[1:]) / 2  # ties, and values just either side of them
    values = np.concatenate([halves, mid.astype(np.float32), np.nextafter(mid.astype(np.float32), np.float32(np.inf)),
                             np.nextafter(mid.astype(np.float32), np.float32(-np.inf)),
                             np.array([1e6, -1e6, 7e4, np.inf, -np.inf], np.float32)])
    out = np.empty(values.size, np.uint16)
    _narrow(values, np.zeros(1, np.uint16), out)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out, values.astype(np.float16).view(np.uint16))
    same = np.empty(values.size, np.float32)
    _narrow(values, np.zeros(1, np.float32), same)  # a float32 pool stores the value as is
    np.testing.assert_array_equal(same, values)
