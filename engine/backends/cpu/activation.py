"""The gated activation of a prefill chunk, act(gate) * up, as one vectorised parallel pass.

numpy's `gate / (1 + exp(-gate)) * up` makes four [T, F] temporaries, one thread each: on a 2K-token chunk of
Qwen2.5-0.5B (F = 4864) that was 0.27 s a layer inside the model, 6.4 of 36 s of the chunk (the profile in
docs/BENCHMARKS.md). Here every element is read once and written once, on every kernel thread, and the
exponential is prefill_attention.fast_exp (a polynomial LLVM vectorises; numba's np.exp is a scalar libm
call, which left this pass at ~15 ns an element):

    silu(g) = g * sigmoid(g),  sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below, e = exp(-|g|)
    gelu_tanh(g) = g / 2 * (1 + tanh(z)) = g * sigmoid(2 z),  z = sqrt(2 / pi) (g + 0.044715 g^3)

both within a few float32 ulps of numpy's (tests/test_cpu_activation.py).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from engine.backends.cpu.gguf_row_kernels import call_kernel
from engine.backends.cpu.numba_cache_deps import key_on_sources
from engine.backends.cpu.prefill_attention import fast_exp

_F32 = np.float32
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}  # no nnan / ninf: a NaN activation stays NaN
SILU, GELU_TANH = 0, 1
KERNEL_ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH}
_GELU_C = _F32(math.sqrt(2.0 / math.pi))
_SPAN = 1024  # elements of one row a task computes: rows split so that a single token uses both threads


@njit(inline="always", fastmath=_FASTMATH)
def _sigmoid(x):
    """1 / (1 + exp(-x)) without overflow or cancellation on either side."""
    e = fast_exp(-abs(x))
    inv = _F32(1.0) / (_F32(1.0) + e)
    return inv if x >= _F32(0.0) else e * inv


@njit(inline="always", fastmath=_FASTMATH)
def _silu(g):
    return g * _sigmoid(g)


@njit(inline="always", fastmath=_FASTMATH)
def _gelu_tanh(g):
    return g * _sigmoid(_F32(2.0) * _GELU_C * (g + _F32(0.044715) * g * g * g))


@njit(parallel=True, cache=True, fastmath=_FASTMATH)
def _activate_rows(gate_up, act, out):
    n_tok, f = out.shape
    spans = (f + _SPAN - 1) // _SPAN
    for task in prange(n_tok * spans):
        t, first = task // spans, (task % spans) * _SPAN
        last = min(f, first + _SPAN)
        if act == SILU:
            for i in range(first, last):
                out[t, i] = _silu(gate_up[t, i]) * gate_up[t, f + i]
        else:
            for i in range(first, last):
                out[t, i] = _gelu_tanh(gate_up[t, i]) * gate_up[t, f + i]


def gated_activation(gate_up: np.ndarray, kind: str) -> np.ndarray:
    """act(gate) * up for gate_up [T, 2F] float32 C-contiguous = (gate | up), kind in KERNEL_ACTIVATIONS."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), _F32)
    call_kernel(_activate_rows, gate_up, KERNEL_ACTIVATIONS[kind], out)
    return out


key_on_sources(globals(), ["engine.backends.cpu.prefill_attention"])
