"""LFM2's short-convolution layers: the recurrent half of a hybrid model.

A short-conv layer replaces attention in its block (llama.cpp `build_shortconv_block`, HF `Lfm2ShortConv`):

    bcx = in_proj(h)                      # [T, 3d]  -> B, C, x gates, d columns each
    u   = B * x                           # [T, d]
    w   = concat(state, u)                # [L-1 + n, d] per sequence: the state is its previous L-1 rows of u
    y_t = sum_k w[t + k] * kernel[:, k]   # depthwise causal convolution of length L
    out = out_proj(C * y)                 # [T, d]
    state <- w[-(L-1):]                   # the rolling state after the sequence's last new token

So the only thing a sequence carries from one step to the next in such a layer is L-1 rows of `u`; a
sequence at position 0 starts from zeros. The state after any position p inside a step is a window of the
rows the step has anyway (w[p - start : p - start + L-1]), so checkpoints are captured inside a chunk
(`ConvStatePool.capture`) instead of cutting the chunk there. Chunked prefill, decode and continuous
batching all go through the same rule: each sequence in a batch reads and writes its own state row (`SeqSlice.state_slot`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.backends.base import Array
from engine.batch import BatchMeta

_F32 = np.float32


@dataclass
class ShortConvWeights:
    in_proj: Array  # linear [3d, d]: B | C | x
    kernel: Array  # [d, L] float32 (GGUF blk.N.shortconv.conv.weight), backend.upload'ed
    out_proj: Array  # linear [d, d]

    @property
    def nbytes(self) -> int:
        return sum(getattr(v, "nbytes", 0) for v in (self.in_proj, self.kernel, self.out_proj))


def load_short_conv(prefix: str, tensor: Callable[[str], np.ndarray], linear: Callable[[list[str]], Array],
                    upload: Callable[[np.ndarray], Array]) -> ShortConvWeights:
    """The short-conv tensors of one layer (`prefix` = "blk.N.") through the loader's helpers."""
    kernel = tensor(prefix + "shortconv.conv.weight")
    if kernel.ndim != 2:
        raise ValueError(f"{prefix}shortconv.conv.weight has shape {kernel.shape}; expected [d, L]")
    return ShortConvWeights(in_proj=linear([prefix + "shortconv.in_proj.weight"]), kernel=upload(kernel),
                            out_proj=linear([prefix + "shortconv.out_proj.weight"]))


class ConvStatePool:
    """Rolling conv states of the short-conv layers a stage owns: conv[layer] is [slots, L-1, d].

    A row (state slot) belongs to one running sequence; it grows on demand. Bytes only, no policy.
    `capture[slot]`: positions whose state the next step of that slot's sequence copies into
    `captured[(slot, p)][layer]` (checkpoints inside a chunk).
    """

    def __init__(self, layers: tuple[int, ...], kernel: int, d_model: int, num_slots: int = 4):
        self.layers, self.rows, self.d_model = tuple(layers), kernel - 1, d_model
        self.conv = {i: np.zeros((num_slots, self.rows, d_model), dtype=_F32) for i in self.layers}
        self.num_slots = num_slots
        self.capture: dict[int, tuple[int, ...]] = {}
        self.captured: dict[tuple[int, int], dict[int, np.ndarray]] = {}

    @property
    def bytes_per_slot(self) -> int:
        return len(self.layers) * self.rows * self.d_model * 4

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv.values())

    def ensure_slot(self, slot: int) -> None:
        if slot < self.num_slots:
            return
        grown = max(slot + 1, 2 * self.num_slots)
        for i, arr in self.conv.items():
            self.conv[i] = np.concatenate([arr, np.zeros((grown - self.num_slots, *arr.shape[1:]), _F32)])
        self.num_slots = grown

    def take_captured(self, slot: int, position: int) -> np.ndarray:
        """The captured state after `position` tokens, every layer of the pool: [layers, L-1, d] (removed)."""
        found = self.captured.pop((slot, position), {})
        assert set(found) == set(self.layers), f"state after {position} tokens was not captured"
        return self._stack([found[i] for i in self.layers])

    def read(self, slot: int) -> np.ndarray:
        """Copy of one slot's state, every layer of the pool: [layers, L-1, d]."""
        return self._stack([self.conv[i][slot] for i in self.layers])

    def _stack(self, rows: list[np.ndarray]) -> np.ndarray:
        return np.stack(rows) if rows else np.zeros((0, self.rows, self.d_model), _F32)

    def write(self, slot: int, state: np.ndarray) -> None:
        self.ensure_slot(slot)
        for j, i in enumerate(self.layers):
            self.conv[i][slot] = state[j]


def numpy_short_conv(u: np.ndarray, kernel: np.ndarray, pool: ConvStatePool, layer: int,
                     batch: BatchMeta) -> np.ndarray:
    """Depthwise causal conv of u [T, d] per sequence, reading and updating each one's state row."""
    rows = pool.rows
    out = np.empty_like(u)
    states = pool.conv[layer]  # [slots, L-1, d]
    for seq in batch.seqs:
        assert seq.state_slot >= 0, "a sequence of a hybrid model has no state slot"
        new = u[seq.query_start : seq.query_start + seq.query_len]  # [n, d]
        prev = states[seq.state_slot] if seq.start_pos > 0 else np.zeros((rows, u.shape[1]), _F32)
        window = np.concatenate([prev, new])  # [L-1 + n, d]
        acc = window[0 : seq.query_len] * kernel[:, 0]
        for k in range(1, rows + 1):
            acc += window[k : k + seq.query_len] * kernel[:, k]
        out[seq.query_start : seq.query_start + seq.query_len] = acc
        states[seq.state_slot] = window[-rows:]
        for p in pool.capture.get(seq.state_slot, ()):
            if seq.start_pos < p <= seq.context_len:  # the state after p tokens: u of positions p-L+1 .. p-1
                offset = p - seq.start_pos
                pool.captured.setdefault((seq.state_slot, p), {})[layer] = window[offset : offset + rows].copy()
    return out


def short_conv_block(b, w: ShortConvWeights, h: Array, batch: BatchMeta, pool: ConvStatePool, layer: int) -> Array:
    """The short-conv mixer of one layer: h [T, d] (the block's input norm) -> [T, d]."""
    d = pool.d_model
    bcx = b.linear(h, w.in_proj)  # [T, 3d]
    gate_b, gate_c, x = bcx[:, :d], bcx[:, d : 2 * d], bcx[:, 2 * d :]
    y = b.short_conv(gate_b * x, w.kernel, pool, layer, batch)  # [T, d]
    return b.linear(gate_c * y, w.out_proj)
