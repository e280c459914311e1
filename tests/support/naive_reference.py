"""A deliberately naive, independent forward pass for the tiny test models.

Written straight from the architectures' definitions, sharing nothing with engine/model.py but GGUF
dequantisation: dense attention with an explicit mask, one sequence, float64, and for llama the
llama.cpp way of rotating adjacent pairs on the stored (permuted) Q/K weights instead of undoing the
permutation. Agreement with the engine therefore checks the permutation handling, RoPE layout, norms,
sliding windows and GQA head mapping, not just self-consistency.
"""
from __future__ import annotations

import numpy as np

from engine.config import ModelConfig
from engine.gguf_file import GGUFFile


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, base, dims, adjacent_pairs):
    # x: [T, H, hd]; rotate the first `dims` features.
    inv = 1.0 / base ** (np.arange(0, dims, 2) / dims)
    ang = pos[:, None] * inv[None, :]  # [T, dims/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if adjacent_pairs:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2] = a * cos - b * sin
        out[..., 1:dims:2] = b * cos + a * sin
    else:
        half = dims // 2
        a, b = x[..., :half], x[..., half:dims]
        out[..., :half] = a * cos - b * sin
        out[..., half:dims] = b * cos + a * sin
    return out


def naive_logits(gguf: GGUFFile, c: ModelConfig, ids: list[int]) -> np.ndarray:
    """Logits [T, vocab] (float64) of a single sequence computed densely from position 0."""
    t = lambda name: gguf.tensor(name).astype(np.float64)  # noqa: E731
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    emb = t("token_embd.weight")
    x = emb[ids] * (np.sqrt(c.d_model) if c.arch == "gemma3" else 1.0)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        h = _rms(x, t(p + "attn_norm.weight"), c.rms_eps)
        q = h @ t(p + "attn_q.weight").T
        k = h @ t(p + "attn_k.weight").T
        v = h @ t(p + "attn_v.weight").T
        if c.arch == "qwen2":
            q, k, v = q + t(p + "attn_q.bias"), k + t(p + "attn_k.bias"), v + t(p + "attn_v.bias")
        q = q.reshape(T, c.n_heads, c.head_dim)
        k = k.reshape(T, c.n_kv_heads, c.head_dim)
        v = v.reshape(T, c.n_kv_heads, c.head_dim)
        if c.arch in ("qwen3", "gemma3"):
            q = _rms(q, t(p + "attn_q_norm.weight"), c.rms_eps)
            k = _rms(k, t(p + "attn_k_norm.weight"), c.rms_eps)
        sliding = c.arch == "gemma3" and (i + 1) % 6 != 0 and c.sliding_window > 0
        base = 10000.0 if sliding else c.rope_base
        q = _rope(q, pos, base, c.rope_dims, adjacent_pairs=c.arch == "llama")
        k = _rope(k, pos, base, c.rope_dims, adjacent_pairs=c.arch == "llama")
        mask = np.tril(np.ones((T, T), dtype=bool))
        if sliding:
            mask &= (pos[:, None] - pos[None, :]) < c.sliding_window
        group = c.n_heads // c.n_kv_heads
        heads = []
        for hd in range(c.n_heads):
            s = q[:, hd] @ k[:, hd // group].T / np.sqrt(c.head_dim)
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            heads.append((s / s.sum(-1, keepdims=True)) @ v[:, hd // group])
        o = np.concatenate(heads, axis=-1) @ t(p + "attn_output.weight").T
        if c.arch == "gemma3":
            o = _rms(o, t(p + "post_attention_norm.weight"), c.rms_eps)
        x = x + o
        h = _rms(x, t(p + "ffn_norm.weight"), c.rms_eps)
        g, u = h @ t(p + "ffn_gate.weight").T, h @ t(p + "ffn_up.weight").T
        if c.arch == "gemma3":
            act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
        else:
            act = g / (1 + np.exp(-g))
        f = (act * u) @ t(p + "ffn_down.weight").T
        if c.arch == "gemma3":
            f = _rms(f, t(p + "post_ffw_norm.weight"), c.rms_eps)
        x = x + f
    x = _rms(x, t("output_norm.weight"), c.rms_eps)
    head = t("output.weight") if gguf.has_tensor("output.weight") else emb
    return x @ head.T
