"""The gated activation of a prefill chunk, act(gate) * up, in blocks of rows that stay in cache, with the
reference's own ufuncs in the reference's order, so every value is bit-identical to
reference/backend.py's `gate / (1 + exp(-gate)) * up`.

The reference's one expression makes four [T, F] temporaries: on a 2K-token chunk of Qwen2.5-0.5B (F = 4864)
each is 40 MB, written and read from memory. A first version here was a numba pass with a polynomial exp:
faster, and within 1e-6 of |gate * up|, but those last-bit differences flipped a near-tie of SmolLM2's
greedy ids with int8 K/V (tests/test_kv_type_accuracy.py), so the numerics stay numpy's and only the memory
traffic goes: one [ROWS, F] scratch, reused.
"""
from __future__ import annotations

import numpy as np

_F32 = np.float32
_GELU_C = _F32(np.sqrt(2.0 / np.pi))
KERNEL_ACTIVATIONS = ("silu", "gelu_tanh")
ROWS = 16  # rows a block: 16 x 4864 floats = 311 KiB of scratch, in L2 with the rows it reads


def gated_activation(gate_up: np.ndarray, kind: str) -> np.ndarray:
    """act(gate) * up for gate_up [T, 2F] float32 = (gate | up), kind in KERNEL_ACTIVATIONS; bit-identical to
    the reference backend's formula."""
    n_tok, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = np.empty((n_tok, f), _F32)
    scratch = np.empty((min(ROWS, n_tok), f), _F32)
    for r0 in range(0, n_tok, ROWS):
        r1 = min(n_tok, r0 + ROWS)
        g, u, t, o = gate_up[r0:r1, :f], gate_up[r0:r1, f:], scratch[: r1 - r0], out[r0:r1]
        if kind == "silu":  # gate / (1.0 + np.exp(-gate)) * up
            np.negative(g, out=t)
            np.exp(t, out=t)
            np.add(1.0, t, out=t)
            np.divide(g, t, out=o)
        else:  # 0.5 * gate * (1.0 + np.tanh(_GELU_C * (gate + 0.044715 * gate * gate * gate))) * up
            np.multiply(_F32(0.044715), g, out=t)
            np.multiply(t, g, out=t)
            np.multiply(t, g, out=t)
            np.add(g, t, out=t)
            np.multiply(_GELU_C, t, out=t)
            np.tanh(t, out=t)
            np.add(1.0, t, out=t)
            np.multiply(0.5, g, out=o)
            np.multiply(o, t, out=o)
        np.multiply(o, u, out=o)
    return out
