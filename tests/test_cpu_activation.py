"""cpu/activation.py's gated activation in row blocks is bit-identical to the reference backend's formula
(for any number of rows, across block borders, with saturated, tiny and non-finite values), and the quantised
backend routes silu / gelu_tanh to it."""
import numpy as np
import pytest

from engine.backends.cpu import activation
from engine.backends.cpu.backend import QuantizedNumpyBackend
from engine.backends.reference.backend import NumpyBackend


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens", [1, 3, 16, 37])
def test_bit_identical_to_the_reference(kind, tokens):
    rng = np.random.default_rng(tokens)
    gate_up = (rng.standard_normal((tokens, 2 * 700)) * 4).astype(np.float32)
    gate_up[0, :6] = (-200.0, 200.0, -1e-30, 0.0, np.nan, np.inf)
    gate_up[-1, 700 + 3] = np.nan  # an up
    with np.errstate(all="ignore"):
        want = NumpyBackend().gated_activation(gate_up, kind)
        got = activation.gated_activation(gate_up, kind)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_quantized_backend_uses_it_for_the_kinds_it_has(monkeypatch):
    calls = []
    real = activation.gated_activation
    monkeypatch.setattr(activation, "gated_activation", lambda x, kind: calls.append(kind) or real(x, kind))
    backend = QuantizedNumpyBackend()
    gate_up = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    backend.gated_activation(gate_up, "silu")
    backend.gated_activation(gate_up, "swiglu_oai")  # not one of them: the reference path
    assert calls == ["silu"]
