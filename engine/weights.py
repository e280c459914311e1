"""Loading a model's tensors from GGUF into a backend, in the layout the model code expects.

Two conversions happen here, once, so the forward pass stays the plain math:
- llama.cpp's converter interleaves the rows of Q and K for the llama arch (its RoPE rotates adjacent
  pairs); we undo that permutation so every arch uses the half-split (NeoX) rotation.
- Q/K/V and gate/up are fused into one matrix each (one matmul instead of three / two per layer).

A backend with `upload_linear_quantized` (CUDA, numpy with --cpu-weights quantized) gets the linears as raw
GGUF rows instead of float32 (engine/quant_weights.py): the same un-permutation and fusion, applied to the
quant blocks. One with `upload_embedding_quantized` (numpy quantized) also gets the token table raw; when
the output head is tied to it, embedding and head are one object over the same file bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from engine.backends.base import Array, Backend
from engine.config import ModelConfig
from engine.gguf_file import GGUFFile
from engine.moe import ExpertWeights
from engine.gated_deltanet import DeltaNetWeights, load_delta_net
from engine.moe_weights import FFN_NORM_TENSOR, load_moe_layer
from engine.qwen3next import SharedExpertWeights, load_shared_expert
from engine.quant_weights import QuantizedLinearLoader
from engine.rope_yarn import yarn_rope_tables
from engine.short_conv import ShortConvWeights, load_short_conv


@dataclass
class LayerWeights:
    attn_norm: Array
    wqkv: Array
    bqkv: Array | None
    q_norm: Array | None
    k_norm: Array | None
    wo: Array
    post_attn_norm: Array | None
    ffn_norm: Array
    w_gate_up: Array | None  # None on MoE layers
    w_down: Array | None
    post_ffn_norm: Array | None
    # -- mixture of experts and gpt-oss attention (engine/moe.py); None on the dense archs --
    moe: ExpertWeights | None = None
    bo: Array | None = None  # attention output bias
    attn_sinks: Array | None = None  # [H]
    short_conv: ShortConvWeights | None = None  # lfm2 short-conv layers (then wqkv, wo, q/k norms are None)
    delta_net: DeltaNetWeights | None = None  # qwen3next DeltaNet layers (then wqkv, wo, q/k norms are None)
    shared_expert: SharedExpertWeights | None = None  # qwen3next: beside the routed experts


@dataclass
class ModelWeights:
    embedding: Array  # [vocab, d]
    layers: list[LayerWeights]
    output_norm: Array
    output: Array  # lm head (the embedding when tied)
    rope_global: tuple[Array, Array]  # cos, sin tables [context, rope_dims / 2]
    rope_local: tuple[Array, Array]


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave: per head, rows (pair, 2) -> (2, pair)."""
    out_dim, in_dim = weight.shape
    head_dim = out_dim // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def rope_tables(base: float, rope_dims: int, max_positions: int, linear_scale: float, freq_factors=None):
    """cos/sin tables [max_positions, rope_dims / 2] in float32 (computed in float64 for accuracy)."""
    inv_freq = 1.0 / (base ** (np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims))
    if freq_factors is not None:  # llama 3.1-style per-frequency divisors stored as rope_freqs.weight
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    # Match the reference: inv_freq and positions multiply in float32.
    inv_freq = inv_freq.astype(np.float32)
    positions = (np.arange(max_positions, dtype=np.float32) / np.float32(linear_scale)).astype(np.float32)
    angles = np.outer(positions, inv_freq).astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def load_weights(gguf: GGUFFile, config: ModelConfig, backend: Backend, max_positions: int) -> ModelWeights:
    """Hand every tensor to the backend in model layout: float32, or linears as raw rows (see above)."""
    c = config
    quantized = QuantizedLinearLoader(gguf, backend) if backend.capabilities.quantized_linears else None

    def t(name: str) -> np.ndarray:
        return gguf.tensor(name)

    def opt(name: str) -> np.ndarray | None:
        return gguf.tensor(name) if gguf.has_tensor(name) else None

    def linear(names: list[str], unpermute_heads: list[int] | None = None) -> Array:
        """The row-stack of `names` as one linear; unpermute_heads[i] > 0 un-permutes part i's Q/K rows."""
        heads = unpermute_heads or [0] * len(names)
        if quantized is not None:
            return quantized.linear(names, heads)
        mats = [unpermute_qk(t(n), h) if h else t(n) for n, h in zip(names, heads)]
        return backend.upload_linear(mats[0] if len(mats) == 1 else np.concatenate(mats, axis=0))

    qk_heads = [c.n_heads, c.n_kv_heads, 0] if c.permuted_qk else None
    ffn_norm_name = FFN_NORM_TENSOR.get(c.arch, "ffn_norm.weight")
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}."
        shared = load_shared_expert(p, t, linear, backend) if c.shared_expert_ffn_dim else None
        if c.layer_is_recurrent and c.layer_is_recurrent[i] and c.delta_net is not None:
            layers.append(_delta_net_layer(p, t, linear, backend, c, load_moe_layer(gguf, p, backend, linear), shared))
            continue
        if c.layer_is_recurrent and c.layer_is_recurrent[i]:
            layers.append(_short_conv_layer(p, t, linear, backend))
            continue
        bias = None
        if c.has_qkv_bias:
            bias = np.concatenate([t(p + "attn_q.bias"), t(p + "attn_k.bias"), t(p + "attn_v.bias")])
        layers.append(
            LayerWeights(
                attn_norm=backend.upload(t(p + "attn_norm.weight")),
                wqkv=linear([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], qk_heads),
                bqkv=None if bias is None else backend.upload(bias),
                q_norm=backend.upload(t(p + "attn_q_norm.weight")) if c.has_qk_norm else None,
                k_norm=backend.upload(t(p + "attn_k_norm.weight")) if c.has_qk_norm else None,
                wo=linear([p + "attn_output.weight"]),
                post_attn_norm=backend.upload(t(p + "post_attention_norm.weight")) if c.has_post_norms else None,
                ffn_norm=backend.upload(t(p + ffn_norm_name)),
                w_gate_up=None if c.n_experts else linear([p + "ffn_gate.weight", p + "ffn_up.weight"]),
                w_down=None if c.n_experts else linear([p + "ffn_down.weight"]),
                post_ffn_norm=backend.upload(t(p + "post_ffw_norm.weight")) if c.has_post_norms else None,
                moe=load_moe_layer(gguf, p, backend, linear) if c.n_experts else None,
                bo=backend.upload(t(p + "attn_output.bias")) if c.has_attn_out_bias else None,
                attn_sinks=backend.upload(t(p + "attn_sinks.weight")) if c.has_attn_sinks else None,
                shared_expert=shared,
            )
        )
    output_name = "output.weight" if gguf.has_tensor("output.weight") else "token_embd.weight"  # tied
    if quantized is not None and backend.capabilities.quantized_embedding:
        embedding = quantized.embedding("token_embd.weight")
        output = embedding if output_name == "token_embd.weight" else linear([output_name])
    elif quantized is not None:
        embedding = backend.upload(t("token_embd.weight"))
        output = linear([output_name])
    else:  # the float path reuses the embedding it already dequantised
        embedding = backend.upload(t("token_embd.weight"))
        output = backend.upload_linear(embedding if output_name == "token_embd.weight" else t(output_name))
    freq_factors = opt("rope_freqs.weight")
    rope_global = rope_tables(c.rope_base, c.rope_dims, max_positions, c.rope_linear_scale, freq_factors)
    rope_local = rope_global
    if c.sliding_window:
        rope_local = rope_tables(c.rope_base_local, c.rope_dims, max_positions, 1.0)
    if c.rope_yarn_factor:  # gpt-oss: YaRN on every layer, sliding or not (llama.cpp, transformers)
        rope_global = rope_local = yarn_rope_tables(c, max_positions)
    return ModelWeights(
        embedding=embedding,
        layers=layers,
        output_norm=backend.upload(t(final_norm_name(gguf))),
        output=output,
        rope_global=(backend.upload(rope_global[0]), backend.upload(rope_global[1])),
        rope_local=(backend.upload(rope_local[0]), backend.upload(rope_local[1])),
    )


def final_norm_name(gguf: GGUFFile) -> str:
    # lfm2's final norm is HF's `embedding_norm`, which llama.cpp stores as token_embd_norm.
    return "output_norm.weight" if gguf.has_tensor("output_norm.weight") else "token_embd_norm.weight"


def _short_conv_layer(p: str, t, linear, backend: Backend) -> LayerWeights:
    return LayerWeights(
        attn_norm=backend.upload(t(p + "attn_norm.weight")), wqkv=None, bqkv=None, q_norm=None, k_norm=None,
        wo=None, post_attn_norm=None, ffn_norm=backend.upload(t(p + "ffn_norm.weight")),
        w_gate_up=linear([p + "ffn_gate.weight", p + "ffn_up.weight"]), w_down=linear([p + "ffn_down.weight"]),
        post_ffn_norm=None, short_conv=load_short_conv(p, t, linear, backend.upload))  # conv kernel: where ops run


def _delta_net_layer(p: str, t, linear, backend: Backend, c: ModelConfig, moe, shared) -> LayerWeights:
    return LayerWeights(
        attn_norm=backend.upload(t(p + "attn_norm.weight")), wqkv=None, bqkv=None, q_norm=None, k_norm=None,
        wo=None, post_attn_norm=None, ffn_norm=backend.upload(t(p + "post_attention_norm.weight")),
        w_gate_up=None, w_down=None, post_ffn_norm=None, moe=moe, shared_expert=shared,
        delta_net=load_delta_net(p, t, linear, c.delta_net))
