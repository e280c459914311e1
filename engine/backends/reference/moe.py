"""numpy reference of the MoE ops (engine/moe.py): expert routing and the grouped expert FFN.

`expert_ffn` sorts the step's (token, slot) pairs by expert once and runs one gate_up and one down
product per expert that got tokens, on exactly those tokens' rows:

    ids [T, k] --stable argsort--> pairs grouped by expert:  [ e0: t3 t7 | e2: t0 | e5: t0 t3 t9 ... ]
    per group:  y = down_e(act(gate_up_e(h[rows]) + b)) + b        out[rows] += w[rows, slot] * y

A token picks an expert at most once, so the rows of one group are distinct and `out[rows] +=` is a
plain scatter; experts are visited in id order, so a token's k contributions are summed in the same
order whatever else is in the batch. Products go through `backend.linear`, so float32 views and
quantised rows (QuantizedNumpyBackend) share this code.
"""
from __future__ import annotations

import numpy as np

_F32 = np.float32


def route_experts(logits: np.ndarray, k: int, gating: str, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids [T, k] int64, weights [T, k] float32) of router logits [T, E] (see engine/moe.py)."""
    logits = np.asarray(logits, dtype=_F32)
    # Stable sort of the negated scores: the k largest, ties to the lower expert id.
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, ids, axis=1)  # [T, k], descending
    if gating == "softmax_topk":
        return ids, _softmax(top)
    if gating != "softmax":
        raise ValueError(f"unknown expert gating {gating!r}")
    # softmax over all E, then the top k of it: exp(top - max) / sum over all experts
    shifted = logits - logits.max(axis=1, keepdims=True)
    denom = np.exp(shifted).sum(axis=1, keepdims=True)
    weights = np.exp(np.take_along_axis(shifted, ids, axis=1)) / denom
    if normalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return ids, weights.astype(_F32, copy=False)


def expert_ffn(backend, h: np.ndarray, moe, ids: np.ndarray, weights: np.ndarray, activation: str) -> np.ndarray:
    """sum_j weights[t, j] * expert_{ids[t, j]}(h[t]) for every row t of h [T, d] -> [T, d]."""
    n_tokens, k = ids.shape
    out = np.zeros((n_tokens, h.shape[1]), dtype=_F32)
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")  # pair indices t * k + j, grouped by expert
    counts = np.bincount(flat, minlength=moe.n_experts)
    start = 0
    for expert in np.flatnonzero(counts):
        pairs = order[start : start + counts[expert]]
        start += counts[expert]
        rows = pairs // k  # distinct tokens of this expert, ascending
        x = h[rows]  # [n_e, d]
        bias = None if moe.gate_up_bias is None else moe.gate_up_bias[expert]
        act = backend.gated_activation(backend.linear(x, moe.gate_up[expert], bias), activation)  # [n_e, F]
        bias = None if moe.down_bias is None else moe.down_bias[expert]
        y = backend.linear(act, moe.down[expert], bias)  # [n_e, d]
        out[rows] += y * weights.reshape(-1)[pairs, None]
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(_F32, copy=False)
