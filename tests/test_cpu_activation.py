"""cpu.activation's gated activation against the float64 formulas: within 1e-6 of |gate * up| (numpy's float32
reference is within the same), NaN kept, no overflow at either end, and the quantised backend routes to it."""
import numpy as np
import pytest

from engine.backends.cpu.activation import gated_activation
from engine.backends.cpu.backend import QuantizedNumpyBackend
from engine.backends.reference.backend import NumpyBackend


def _truth(gate_up: np.ndarray, kind: str) -> np.ndarray:
    f = gate_up.shape[1] // 2
    g, u = gate_up[:, :f].astype(np.float64), gate_up[:, f:].astype(np.float64)
    if kind == "silu":
        return g / (1.0 + np.exp(-g)) * u
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3))) * u


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_within_float32_rounding_of_the_formula(kind, tokens):
    rng = np.random.default_rng(tokens)
    gate_up = (rng.standard_normal((tokens, 2 * 2600)) * 4).astype(np.float32)  # 2600: spans of 1024 + a rest
    gate_up[0, :4] = (-200.0, 200.0, -1e-30, 0.0)  # saturated both ways, tiny, zero
    got = gated_activation(gate_up, kind)
    f = gate_up.shape[1] // 2
    bound = 1e-6 * np.abs(gate_up[:, :f].astype(np.float64) * gate_up[:, f:]) + 1e-37
    with np.errstate(over="ignore"):
        assert np.all(np.abs(got - _truth(gate_up, kind)) <= bound)
        assert np.all(np.abs(NumpyBackend().gated_activation(gate_up, kind) - _truth(gate_up, kind)) <= bound)


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_nan_stays_nan(kind):
    gate_up = np.ones((2, 64), np.float32)
    gate_up[1, 3] = np.nan  # a gate
    gate_up[0, 32 + 5] = np.nan  # an up
    got = gated_activation(gate_up, kind)
    assert np.isnan(got[1, 3]) and np.isnan(got[0, 5]) and np.isfinite(got).sum() == got.size - 2


def test_quantized_backend_uses_the_kernel_where_it_applies(monkeypatch):
    calls = []
    import engine.backends.cpu.activation as module

    real = module.gated_activation
    monkeypatch.setattr(module, "gated_activation", lambda x, kind: calls.append(kind) or real(x, kind))
    backend = QuantizedNumpyBackend()
    gate_up = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    expected = NumpyBackend().gated_activation(gate_up, "silu")
    np.testing.assert_allclose(backend.gated_activation(gate_up, "silu"), expected, rtol=1e-6, atol=1e-7)
    backend.gated_activation(gate_up[:, ::2].copy(order="F"), "silu")  # not C-contiguous: the numpy path
    backend.gated_activation(gate_up, "swiglu_oai")  # no kernel: the numpy path
    assert calls == ["silu"]
