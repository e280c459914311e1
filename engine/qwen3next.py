"""Qwen3-Next's parts beside the DeltaNet mixer (engine/gated_deltanet.py): the gated attention's output
gate, the sigmoid-gated shared expert, and the loading of a layer's tensors.

    gated attention  attn_q rows per head are [query (hd) | gate (hd)]; Q/K RMS-norm, partial NeoX RoPE
                     (rope_dims of hd), softmax attention, then out * sigmoid(gate) before attn_output
    MoE              routed experts as qwen3moe (engine/moe.py: softmax -> top-k -> renormalised)
                     + sigmoid(h . ffn_gate_inp_shexp) * down_shexp(silu(gate_shexp h) * up_shexp h)
    norms            attn_norm before the mixer, post_attention_norm before the MoE (plain RMS norms:
                     llama.cpp's converter stores HF's zero-centred (1 + w) weights as 1 + w)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.backends.base import Array, Backend

_F32 = np.float32


@dataclass
class SharedExpertWeights:
    gate_up: Array  # linear [2F, d]
    down: Array  # linear [d, F]
    gate: Array  # linear [1, d]: the expert's scalar sigmoid gate per token

    @property
    def nbytes(self) -> int:
        return sum(getattr(v, "nbytes", 0) for v in (self.gate_up, self.down, self.gate))


def load_shared_expert(prefix: str, tensor, linear, backend: Backend) -> SharedExpertWeights:
    gate = np.ascontiguousarray(tensor(prefix + "ffn_gate_inp_shexp.weight"), _F32).reshape(1, -1)
    return SharedExpertWeights(gate_up=linear([prefix + "ffn_gate_shexp.weight", prefix + "ffn_up_shexp.weight"]),
                               down=linear([prefix + "ffn_down_shexp.weight"]), gate=backend.upload_linear(gate))


def shared_expert_ffn(b: Backend, h: Array, w: SharedExpertWeights) -> Array:
    """sigmoid(gate . h) * SwiGLU expert(h): [T, d] -> [T, d]."""
    y = b.linear(b.gated_activation(b.linear(h, w.gate_up), "silu"), w.down)  # [T, d]
    return y / (1.0 + np.exp(-b.linear(h, w.gate)))  # [T, 1] broadcast over d


def split_query_gate(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[T, 2H, hd] with each head's rows [query | gate] -> (query [T, H, hd], gate [T, H, hd])."""
    return q[:, 0::2], q[:, 1::2]


def apply_output_gate(out: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """Attention output [T, H hd] times sigmoid(gate) [T, H, hd]."""
    return out / (1.0 + np.exp(-gate.reshape(out.shape)))
