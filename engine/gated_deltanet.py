"""Qwen3-Next's gated DeltaNet layers: the recurrent half of the hybrid (llama.cpp build_layer_attn_linear,
HF Qwen3NextGatedDeltaNet). The math of the delta rule is in engine/delta_rule.py; here the layer around it:

    proj   = in_proj(h)                         [T, conv_dim + Hv dv + 2 Hv]: qkv | z | ba (one fused linear)
    qkv    = silu(causal_conv1d(qkv))           length L, each sequence's L-1 previous rows as its conv state
    q, k   = l2norm(q) dk^-1/2, l2norm(k)       [T, Hk, dk], repeated to the Hv value heads (head h reads h // r)
    beta   = sigmoid(b),  g = ssm_a * softplus(a + dt_bias)       [T, Hv]; ssm_a = -exp(A_log) < 0
    o      = gated delta rule(q, k, v, beta, g; S)                [T, Hv, dv]; S [Hv, dk, dv] per sequence
    out    = out_proj(rms_norm(o) * ssm_norm * silu(z))

ba's rows come per key-head group as in HF: [b (r) | a (r)] for group 0, then group 1, ... (r = Hv / Hk).
A sequence's state is its conv rows and S (`DeltaNetStatePool`, one slot per running sequence, the same
slot in every stage); at position 0 both start from zeros whatever the slot holds. Prefill runs the rule in
chunks per sequence; the sequences of a step that bring one token each (decode) take one vectorised
recurrent step together. States after chosen positions are captured inside the step (checkpoints).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.backends.base import Array
from engine.batch import BatchMeta
from engine.delta_rule import chunked, l2_normalize, recurrent_step
from engine.qwen3next_config import DeltaNetShape
from engine.short_conv import numpy_short_conv

_F32 = np.float32


@dataclass
class DeltaNetWeights:
    in_proj: Array  # linear [conv_dim + Hv dv + 2 Hv, d]: attn_qkv | attn_gate | ssm_ba
    conv: np.ndarray  # [conv_dim, L] float32 (ssm_conv1d.weight)
    dt_bias: np.ndarray  # [Hv]
    ssm_a: np.ndarray  # [Hv], -exp(A_log)
    norm: np.ndarray  # [dv] (ssm_norm.weight)
    out_proj: Array  # linear [d, Hv dv]

    @property
    def nbytes(self) -> int:
        parts = (self.in_proj, self.conv, self.dt_bias, self.ssm_a, self.norm, self.out_proj)
        return sum(getattr(v, "nbytes", 0) for v in parts)


def load_delta_net(prefix: str, tensor: Callable[[str], np.ndarray], linear: Callable[[list[str]], Array],
                   shape: DeltaNetShape) -> DeltaNetWeights:
    """The DeltaNet tensors of one layer (`prefix` = "blk.N.") through the loader's helpers."""
    conv = np.ascontiguousarray(tensor(prefix + "ssm_conv1d.weight"), _F32)
    if conv.shape != (shape.conv_dim, shape.conv_kernel):
        raise ValueError(f"{prefix}ssm_conv1d.weight has shape {conv.shape}; the metadata implies "
                         f"{(shape.conv_dim, shape.conv_kernel)}")
    small = lambda name: np.ascontiguousarray(tensor(prefix + name), _F32).reshape(-1)  # noqa: E731
    return DeltaNetWeights(
        in_proj=linear([prefix + "attn_qkv.weight", prefix + "attn_gate.weight", prefix + "ssm_ba.weight"]),
        conv=conv, dt_bias=small("ssm_dt.bias"), ssm_a=small("ssm_a"), norm=small("ssm_norm.weight"),
        out_proj=linear([prefix + "ssm_out.weight"]))


class DeltaNetStatePool:
    """States of the DeltaNet layers a stage owns, per slot: conv[layer] [slots, L-1, conv_dim] and
    ssm[layer] [slots, Hv, dk, dv]. `read` / `write` see one slot as [layers, 1, state_floats] (conv rows,
    then S, flattened), the unit the conversation cache checkpoints. `capture` / `captured` as
    engine/short_conv.ConvStatePool: states after chosen positions, copied out of the next step."""

    def __init__(self, layers: tuple[int, ...], shape: DeltaNetShape, num_slots: int = 4):
        self.layers, self.shape, self.rows = tuple(layers), shape, shape.conv_kernel - 1
        s = shape
        self.conv = {i: np.zeros((num_slots, self.rows, s.conv_dim), _F32) for i in self.layers}
        self.ssm = {i: np.zeros((num_slots, s.n_v_heads, s.k_head_dim, s.v_head_dim), _F32) for i in self.layers}
        self.num_slots = num_slots
        self.capture: dict[int, tuple[int, ...]] = {}
        self.captured: dict[tuple[int, int], dict[int, np.ndarray]] = {}

    @property
    def bytes_per_slot(self) -> int:
        return len(self.layers) * self.shape.state_floats * 4

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.conv.values(), *self.ssm.values()))

    def ensure_slot(self, slot: int) -> None:
        if slot < self.num_slots:
            return
        grown = max(slot + 1, 2 * self.num_slots)
        for pools in (self.conv, self.ssm):
            for i, arr in pools.items():
                pools[i] = np.concatenate([arr, np.zeros((grown - self.num_slots, *arr.shape[1:]), _F32)])
        self.num_slots = grown

    def read(self, slot: int) -> np.ndarray:
        """Copy of one slot's state, every layer of the pool: [layers, 1, state_floats]."""
        return self._stack([_flat(self.conv[i][slot], self.ssm[i][slot]) for i in self.layers])

    def write(self, slot: int, state: np.ndarray) -> None:
        self.ensure_slot(slot)
        split = self.rows * self.shape.conv_dim
        for j, i in enumerate(self.layers):
            self.conv[i][slot] = state[j, 0, :split].reshape(self.conv[i].shape[1:])
            self.ssm[i][slot] = state[j, 0, split:].reshape(self.ssm[i].shape[1:])

    def take_captured(self, slot: int, position: int) -> np.ndarray:
        """The captured state after `position` tokens, every layer of the pool (removed)."""
        found = self.captured.pop((slot, position), {})
        assert set(found) == set(self.layers), f"state after {position} tokens was not captured"
        return self._stack([found[i] for i in self.layers])

    def _stack(self, rows: list[np.ndarray]) -> np.ndarray:
        return np.stack(rows)[:, None, :] if rows else np.zeros((0, 1, self.shape.state_floats), _F32)


def _flat(conv_rows: np.ndarray, ssm: np.ndarray) -> np.ndarray:
    return np.concatenate([conv_rows.reshape(-1), ssm.reshape(-1)])


def gated_deltanet_block(b, w: DeltaNetWeights, h: Array, batch: BatchMeta, pool: DeltaNetStatePool,
                         layer: int, eps: float) -> Array:
    """The DeltaNet mixer of one layer: h [T, d] (the block's input norm) -> [T, d]."""
    s, n_tokens = pool.shape, h.shape[0]
    proj = b.linear(h, w.in_proj)  # [T, conv_dim + Hv dv + 2 Hv]
    z = proj[:, s.conv_dim : s.conv_dim + s.value_dim].reshape(n_tokens, s.n_v_heads, s.v_head_dim)
    r = s.n_v_heads // s.n_k_heads
    ba = proj[:, s.conv_dim + s.value_dim :].reshape(n_tokens, s.n_k_heads, 2, r)
    beta = 1.0 / (1.0 + np.exp(-ba[:, :, 0].reshape(n_tokens, s.n_v_heads)))  # [T, Hv]
    g = w.ssm_a * np.logaddexp(_F32(0.0), ba[:, :, 1].reshape(n_tokens, s.n_v_heads) + w.dt_bias)  # [T, Hv]
    qkv = _conv_silu(proj[:, : s.conv_dim], w.conv, pool, layer, batch)  # [T, conv_dim]
    q = l2_normalize(qkv[:, : s.key_dim].reshape(n_tokens, s.n_k_heads, s.k_head_dim)) * _F32(s.k_head_dim ** -0.5)
    k = l2_normalize(qkv[:, s.key_dim : 2 * s.key_dim].reshape(n_tokens, s.n_k_heads, s.k_head_dim))
    q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)  # [T, Hv, dk]
    v = qkv[:, 2 * s.key_dim :].reshape(n_tokens, s.n_v_heads, s.v_head_dim)
    o = _delta_rule(q, k, v, beta.astype(_F32), g.astype(_F32), pool, layer, batch)  # [T, Hv, dv]
    normed = o / np.sqrt(np.einsum("...i,...i->...", o, o)[..., None] / _F32(s.v_head_dim) + _F32(eps)) * w.norm
    gated = normed * (z / (1.0 + np.exp(-z)))  # rms_norm(o) * w * silu(z)
    return b.linear(gated.reshape(n_tokens, s.value_dim), w.out_proj)


def _conv_silu(x: np.ndarray, kernel: np.ndarray, pool: DeltaNetStatePool, layer: int, batch: BatchMeta):
    """silu of the depthwise causal conv of x [T, C] per sequence: lfm2's conv (engine/short_conv.py), which
    reads and updates the pool's conv rows and captures them at checkpoint positions the same way."""
    out = numpy_short_conv(x, kernel, pool, layer, batch)
    return out / (1.0 + np.exp(-out))


def _delta_rule(q, k, v, beta, g, pool: DeltaNetStatePool, layer: int, batch: BatchMeta) -> np.ndarray:
    """The rule over every sequence of the batch: one vectorised step for the one-token ones, chunks for
    the others; each reads and writes its S. Completes the captures _conv_silu began with S."""
    out, states = np.empty_like(v), pool.ssm[layer]
    single = [seq for seq in batch.seqs if seq.query_len == 1]
    if single:
        rows = np.array([seq.query_start for seq in single])
        slots = np.array([seq.state_slot for seq in single])
        current = states[slots]  # [B, Hv, dk, dv] (a copy)
        current[[seq.start_pos == 0 for seq in single]] = 0.0
        out[rows] = recurrent_step(q[rows], k[rows], v[rows], beta[rows], g[rows], current)
        states[slots] = current
        for seq, state in zip(single, current):
            _keep_capture(pool, seq, layer, {seq.context_len: state})
    for seq in batch.seqs:
        if seq.query_len == 1:
            continue
        span = slice(seq.query_start, seq.query_start + seq.query_len)
        state = states[seq.state_slot] if seq.start_pos > 0 else np.zeros(states.shape[1:], _F32)
        wanted = [p - seq.start_pos for p in pool.capture.get(seq.state_slot, ()) if seq.start_pos < p <= seq.context_len]
        head_major = [x[span].swapaxes(0, 1) for x in (q, k, v, beta, g)]  # [Hv, n, ...]
        o, captured = chunked(*head_major, state, capture_rows=wanted)
        out[span] = o.swapaxes(0, 1)
        states[seq.state_slot] = state
        _keep_capture(pool, seq, layer, {seq.start_pos + r: s for r, s in captured.items()})
    return out


def _keep_capture(pool: DeltaNetStatePool, seq, layer: int, by_position: dict[int, np.ndarray]) -> None:
    """Append S to the conv rows _conv_silu captured at the same positions (only those it was asked for)."""
    for p, state in by_position.items():
        entry = pool.captured.get((seq.state_slot, p))
        if entry is not None and layer in entry and entry[layer].ndim == 2:
            entry[layer] = _flat(entry[layer], state)
