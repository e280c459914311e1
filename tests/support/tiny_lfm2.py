"""A tiny random-weight `lfm2` GGUF (short-conv + attention hybrid) in llama.cpp's layout.

What `convert_hf_to_gguf.py`'s LFM2Model writes, at toy size: `lfm2.attention.head_count_kv` is a
per-layer list with 0 on the short-conv layers, `lfm2.shortconv.l_cache` is the conv length L, the conv
kernel is stored squeezed as `blk.N.shortconv.conv.weight` [d, L], the final norm (HF `embedding_norm`)
is `token_embd_norm.weight`, Q/K are not permuted (NEOX RoPE) and the output head is tied. The file is a
pure function of its arguments (seeded), so tests regenerate it instead of committing it.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import LlamaFileType

from tests.support.tiny_gguf import finish_tiny_gguf, tiny_vocab

# c = short conv, a = attention; LFM2-350M starts c c a c c a ...
DEFAULT_PATTERN = "ccaca"


def write_tiny_lfm2(path, seed: int = 0, pattern: str = DEFAULT_PATTERN, n_embd: int = 64, n_head: int = 4,
                    n_head_kv: int = 2, n_ff: int = 128, conv_l: int = 3, n_ctx: int = 512,
                    rope_base: float = 1_000_000.0, rms_eps: float = 1e-5, weight_scale: float = 0.2,
                    embd_scale: float = 0.1, norm_scale: float = 0.1, output_ids: list[int] | None = None) -> dict:
    """Write the GGUF; returns its config (arch, path, vocab_size, pattern, ..., eos_id) and `tensors`
    ({name: float32 array as stored}). `output_ids`: an untied head whose other rows are zero, so greedy
    decoding only ever picks these tokens (benchmarks pick ones whose text re-encodes to the same ids)."""
    tokens, types, merges = tiny_vocab()
    vocab, head_dim = len(tokens), n_embd // n_head
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = weight_scale) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * norm_scale).astype(np.float32)

    tensors = {"token_embd.weight": mat(vocab, n_embd, embd_scale)}
    for i, kind in enumerate(pattern):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm(n_embd)
        if kind == "c":
            tensors[p + "shortconv.in_proj.weight"] = mat(3 * n_embd, n_embd)
            tensors[p + "shortconv.conv.weight"] = mat(n_embd, conv_l, 0.5)
            tensors[p + "shortconv.out_proj.weight"] = mat(n_embd, n_embd)
        else:
            tensors[p + "attn_q.weight"] = mat(n_head * head_dim, n_embd)
            tensors[p + "attn_k.weight"] = mat(n_head_kv * head_dim, n_embd)
            tensors[p + "attn_v.weight"] = mat(n_head_kv * head_dim, n_embd)
            tensors[p + "attn_q_norm.weight"] = norm(head_dim)
            tensors[p + "attn_k_norm.weight"] = norm(head_dim)
            tensors[p + "attn_output.weight"] = mat(n_embd, n_head * head_dim)
        tensors[p + "ffn_norm.weight"] = norm(n_embd)
        tensors[p + "ffn_gate.weight"] = mat(n_ff, n_embd)
        tensors[p + "ffn_up.weight"] = mat(n_ff, n_embd)
        tensors[p + "ffn_down.weight"] = mat(n_embd, n_ff)
    tensors["token_embd_norm.weight"] = norm(n_embd)
    if output_ids is not None:
        head = np.zeros((vocab, n_embd), np.float32)
        head[output_ids] = mat(len(output_ids), n_embd, 1.0)
        tensors["output.weight"] = head

    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_type("model")
    w.add_name("tiny-lfm2")
    w.add_block_count(len(pattern))
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv([n_head_kv if kind == "a" else 0 for kind in pattern])
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(vocab)
    w.add_shortconv_l_cache(conv_l)
    w.add_file_type(int(LlamaFileType.ALL_F32))
    finish_tiny_gguf(w, tokens, types, merges, {name: (arr, None) for name, arr in tensors.items()})
    return {"arch": "lfm2", "path": str(Path(path)), "vocab_size": vocab, "pattern": pattern, "n_embd": n_embd,
            "n_head": n_head, "n_head_kv": n_head_kv, "head_dim": head_dim, "n_ff": n_ff, "conv_l": conv_l,
            "n_ctx": n_ctx, "rope_base": rope_base, "rms_eps": rms_eps, "seed": seed, "bos_id": 1, "eos_id": 2,
            "tensors": tensors}
