"""The transformer forward pass, written once against the Backend protocol.

Covers llama (SmolLM2, Llama 3), qwen2 (QKV bias), qwen3 (QK-norm) and gemma3 (QK-norm, post norms,
sliding-window layers with their own RoPE base, GELU gating, embedding scale) through config flags; the
MoE archs (engine/moe.py) and the hybrids lfm2 (engine/short_conv.py) and qwen3next (gated DeltaNet layers,
engine/gated_deltanet.py; gated attention and a shared expert, engine/qwen3next.py).
Shapes: T = tokens in the batch (all sequences, flat), d = model width, H/KVH = query/KV heads.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backends.base import Backend
from engine.backends.placement import refusal
from engine.batch import BatchMeta
from engine.config import ModelConfig, config_from_gguf
from engine.gguf_file import GGUFFile
from engine.gated_deltanet import gated_deltanet_block
from engine.moe import moe_ffn
from engine.qwen3next import apply_output_gate, shared_expert_ffn, split_query_gate
from engine.short_conv import short_conv_block
from engine.units import MIB
from engine.weights import ModelWeights, load_weights

log = logging.getLogger("strata.model")


class Model:
    """A loaded model: config + weights on a backend. `forward` runs one batched step."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, backend: Backend):
        self.config = config
        self.weights = weights
        self.backend = backend

    def forward(self, batch: BatchMeta, kv_pool, state_pool=None) -> np.ndarray:
        """Run every new token of the batch through the model, writing its K/V into kv_pool (and, for a
        hybrid model, each sequence's recurrent state into state_pool).

        Returns float32 logits [len(batch.logit_rows), vocab] on the host.
        """
        hidden = self.embed(batch)
        hidden = self.run_layers(hidden, batch, kv_pool, range(self.config.n_layers), state_pool=state_pool)
        return self.head(hidden)

    # A pipeline stage runs one slice of the three parts below: stage 0 embeds, every stage runs its layer
    # range against its own KV pool, the last stage applies the head. `hidden` is (x, h): the residual
    # stream and its norm for the next layer, handed from stage to stage unchanged, so a split model
    # computes exactly what the whole model computes.
    def embed(self, batch: BatchMeta, backend: Backend | None = None) -> tuple:
        """Token embeddings (x) and the first layer's input norm (h)."""
        c, w, b = self.config, self.weights, backend or self.backend
        x = b.embedding(w.embedding, batch.token_ids, c.embed_scale)  # [T, d]
        return x, b.rms_norm(x, w.layers[0].attn_norm, c.rms_eps)

    def run_layers(self, hidden: tuple, batch: BatchMeta, kv_pool, layers: range,
                   backend: Backend | None = None, state_pool=None) -> tuple:
        """Layers `layers` (consecutive); kv_pool holds the K/V of exactly those layers that keep K/V (layer i
        at index kv_index(i) - kv_index(layers.start); i - layers.start when no layer is recurrent).

        After the model's last layer x is reduced to the rows whose logits are wanted and h is None.
        `backend`: a stage's own handle on the weights' backend (CUDA: its stream); default the model's.
        `state_pool`: the stage's recurrent-state pool (engine/short_conv.ConvStatePool) for a hybrid model.
        """
        c, w, b = self.config, self.weights, backend or self.backend
        x, h = hidden
        for i in layers:
            lw = w.layers[i]
            if lw.short_conv is not None:
                attn = short_conv_block(b, lw.short_conv, h, batch, state_pool, i)  # [T, d]
            elif lw.delta_net is not None:
                attn = gated_deltanet_block(b, lw.delta_net, h, batch, state_pool, i, c.rms_eps)  # [T, d]
            else:
                attn = self._attention(b, i, h, batch, kv_pool, c.kv_index(i) - c.kv_index(layers.start))
            if lw.post_attn_norm is not None:
                attn = b.rms_norm(attn, lw.post_attn_norm, c.rms_eps)
            x, h = b.add_rms_norm(x, attn, lw.ffn_norm, c.rms_eps)
            if lw.moe is not None:
                mlp = moe_ffn(b, h, lw.moe, c)  # [T, d]
                if lw.shared_expert is not None:
                    mlp = mlp + shared_expert_ffn(b, h, lw.shared_expert)
            else:
                mlp = b.linear(b.gated_activation(b.linear(h, lw.w_gate_up), c.activation), lw.w_down)
            if lw.post_ffn_norm is not None:
                mlp = b.rms_norm(mlp, lw.post_ffn_norm, c.rms_eps)
            next_norm = w.layers[i + 1].attn_norm if i + 1 < c.n_layers else None
            if next_norm is not None:
                x, h = b.add_rms_norm(x, mlp, next_norm, c.rms_eps)
            else:
                x, h = b.gather_rows(x + mlp, batch.logit_rows), None  # only rows whose logits are wanted
        return x, h

    def head(self, hidden: tuple, backend: Backend | None = None) -> np.ndarray:
        """Final norm and output projection of the model's last layer output -> host logits."""
        c, w, b = self.config, self.weights, backend or self.backend
        h = b.rms_norm(hidden[0], w.output_norm, c.rms_eps)
        return b.to_host(b.linear(h, w.output))  # [rows, vocab]

    def _attention(self, b: Backend, i: int, h, batch: BatchMeta, kv_pool, pool_layer: int):
        c, lw = self.config, self.weights.layers[i]
        qkv = b.linear(h, lw.wqkv, lw.bqkv)  # [T, (H + 2 KVH) hd]; qwen3next: [T, (2H + 2 KVH) hd]
        q_dim = 2 * c.q_dim if c.has_attn_gate else c.q_dim
        q, k, v = b.split_heads(qkv, (q_dim, c.kv_dim, c.kv_dim), c.head_dim)  # [T, H|KVH, hd]
        gate = None
        if c.has_attn_gate:
            q, gate = split_query_gate(q)  # [T, H, hd] each
        if lw.q_norm is not None:
            q = b.rms_norm(q, lw.q_norm, c.rms_eps)
            k = b.rms_norm(k, lw.k_norm, c.rms_eps)
        sliding = c.layer_is_sliding[i]
        cos_sin = self.weights.rope_local if sliding else self.weights.rope_global
        q = b.rope(q, batch.positions, cos_sin, c.rope_dims)
        k = b.rope(k, batch.positions, cos_sin, c.rope_dims)
        b.store_kv(kv_pool, pool_layer, k, v, batch)
        window = c.sliding_window if sliding else 0
        sinks = {} if lw.attn_sinks is None else {"sinks": lw.attn_sinks}  # gpt-oss only
        out = b.attention(q, kv_pool, pool_layer, batch, c.attn_scale, window, **sinks)  # [T, H hd]
        if gate is not None:
            out = apply_output_gate(out, gate)
        return b.linear(out, lw.wo, lw.bo)


@dataclass(frozen=True)
class LoadInfo:
    path: Path
    load_seconds: float
    weight_bytes: int  # bytes the backend holds for weights (float32, or quantised blocks), each buffer once


def load_model(path: str | Path, backend: Backend, max_positions: int | None = None):
    """Open a GGUF, build its config and upload its weights. Returns (Model, GGUFFile, LoadInfo)."""
    started = time.perf_counter()
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf.fields, vocab_size=gguf.tensor_shape("token_embd.weight")[0])
    reason = refusal(config.arch, backend.name, backend.capabilities)
    if reason is not None:
        raise ValueError(f"{Path(path).name}: {reason}")
    positions = max_positions or config.context_length
    weights = load_weights(gguf, config, backend, positions)
    weight_bytes = _count_bytes(weights)
    info = LoadInfo(Path(path), time.perf_counter() - started, weight_bytes)
    log.info(
        "loaded %s: arch=%s layers=%d d=%d heads=%d/%d in %.1f s (%.0f MiB of weights)",
        Path(path).name, config.arch, config.n_layers, config.d_model, config.n_heads, config.n_kv_heads,
        info.load_seconds, weight_bytes / MIB,
    )
    return Model(config, weights, backend), gguf, info


def _count_bytes(weights: ModelWeights) -> int:
    # A tied output head is the embedding object itself: count it once.
    values = [weights.embedding, weights.output, weights.output_norm]
    for layer in weights.layers:
        values += [v for v in vars(layer).values() if v is not None]
    return sum(getattr(v, "nbytes", 0) for v in {id(v): v for v in values}.values())
