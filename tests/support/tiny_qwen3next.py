"""A tiny random-weight `qwen3next` GGUF (gated DeltaNet + gated attention + MoE) in llama.cpp's layout.

The same tensor names, shapes and metadata keys as llama.cpp's convert_hf_to_gguf.py writes for
Qwen3NextForCausalLM (tests/test_qwen3next.py holds them equal to tests/data/qwen3next_tiny.gguf, which the
converter wrote): `qwen3next.attention.recurrent_layers`, the `ssm.*` sizes, attn_qkv / attn_gate / ssm_ba /
ssm_conv1d [conv_dim, L] / ssm_dt.bias / ssm_a (= -exp(A_log)) / ssm_norm / ssm_out on DeltaNet layers,
attn_q with [query | gate] rows per head on attention layers, routed experts plus the shared expert and
its [1, d] gate in every layer, plain RMS-norm weights (the converter's 1 + w). The file is a pure function
of its arguments (seeded): the cache and API tests write the sizes they need instead of committing files.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import LlamaFileType

from tests.support.tiny_gguf import finish_tiny_gguf, tiny_vocab

ARCH = "qwen3next"


def write_tiny_qwen3next(path, seed: int = 0, pattern: str = "rrra", n_embd: int = 64, n_head: int = 4,
                         n_head_kv: int = 2, head_dim: int = 32, rope_dims: int = 8, n_k_heads: int = 2,
                         n_v_heads: int = 4, k_head_dim: int = 16, v_head_dim: int = 16, conv_l: int = 4,
                         n_expert: int = 4, n_expert_used: int = 2, n_ff_exp: int = 16, n_ff_shexp: int = 32,
                         n_ff: int = 128, n_ctx: int = 512, rope_base: float = 1_000_000.0, rms_eps: float = 1e-6,
                         output_ids: list[int] | None = None) -> dict:
    """Write the GGUF ("r" = DeltaNet layer, "a" = attention in `pattern`); returns its config and `tensors`.
    `output_ids`: a head whose other rows are zero, so greedy decoding only picks these tokens."""
    tokens, types, merges = tiny_vocab()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    key_dim, value_dim = n_k_heads * k_head_dim, n_v_heads * v_head_dim
    conv_dim = 2 * key_dim + value_dim

    def mat(*shape: int, scale: float | None = None) -> np.ndarray:
        scale = 1.0 / np.sqrt(shape[-1]) if scale is None else scale
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    tensors = {"token_embd.weight": mat(vocab, n_embd, scale=1.0)}
    for i, kind in enumerate(pattern):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm(n_embd)
        if kind == "r":
            tensors[p + "attn_qkv.weight"] = mat(conv_dim, n_embd)
            tensors[p + "attn_gate.weight"] = mat(value_dim, n_embd)
            tensors[p + "ssm_ba.weight"] = mat(2 * n_v_heads, n_embd)
            tensors[p + "ssm_conv1d.weight"] = mat(conv_dim, conv_l, scale=0.5)
            tensors[p + "ssm_dt.bias"] = mat(n_v_heads, scale=0.5)
            # -exp(A_log), log-uniform in 0.02 .. 2: some heads keep a long memory, some a short one
            tensors[p + "ssm_a"] = -np.exp(rng.uniform(np.log(0.02), np.log(2.0), n_v_heads)).astype(np.float32)
            tensors[p + "ssm_norm.weight"] = norm(v_head_dim)
            tensors[p + "ssm_out.weight"] = mat(n_embd, value_dim)
        else:
            tensors[p + "attn_q.weight"] = mat(2 * n_head * head_dim, n_embd)
            tensors[p + "attn_k.weight"] = mat(n_head_kv * head_dim, n_embd)
            tensors[p + "attn_v.weight"] = mat(n_head_kv * head_dim, n_embd)
            tensors[p + "attn_q_norm.weight"] = norm(head_dim)
            tensors[p + "attn_k_norm.weight"] = norm(head_dim)
            tensors[p + "attn_output.weight"] = mat(n_embd, n_head * head_dim)
        tensors[p + "post_attention_norm.weight"] = norm(n_embd)
        tensors[p + "ffn_gate_inp.weight"] = mat(n_expert, n_embd, scale=3.0 / np.sqrt(n_embd))
        tensors[p + "ffn_gate_exps.weight"] = mat(n_expert, n_ff_exp, n_embd)
        tensors[p + "ffn_up_exps.weight"] = mat(n_expert, n_ff_exp, n_embd)
        tensors[p + "ffn_down_exps.weight"] = mat(n_expert, n_embd, n_ff_exp)
        tensors[p + "ffn_gate_inp_shexp.weight"] = mat(1, n_embd)
        tensors[p + "ffn_gate_shexp.weight"] = mat(n_ff_shexp, n_embd)
        tensors[p + "ffn_up_shexp.weight"] = mat(n_ff_shexp, n_embd)
        tensors[p + "ffn_down_shexp.weight"] = mat(n_embd, n_ff_shexp)
    tensors["output_norm.weight"] = norm(n_embd)
    head = mat(vocab, n_embd)
    if output_ids is not None:
        keep = np.zeros(vocab, bool)
        keep[output_ids] = True
        head[~keep] = 0.0
        head[keep] *= 4.0  # positive logits dominate the zero rows
    tensors["output.weight"] = head

    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_type("model")
    w.add_name("tiny-qwen3next")
    for key, value in (("block_count", len(pattern)), ("context_length", n_ctx), ("embedding_length", n_embd),
                       ("feed_forward_length", n_ff), ("attention.head_count", n_head),
                       ("attention.head_count_kv", n_head_kv), ("expert_count", n_expert),
                       ("expert_used_count", n_expert_used), ("attention.key_length", head_dim),
                       ("attention.value_length", head_dim), ("expert_feed_forward_length", n_ff_exp),
                       ("expert_shared_feed_forward_length", n_ff_shexp), ("ssm.conv_kernel", conv_l),
                       ("ssm.state_size", k_head_dim), ("ssm.group_count", n_k_heads),
                       ("ssm.time_step_rank", n_v_heads), ("ssm.inner_size", value_dim),
                       ("full_attention_interval", 4), ("rope.dimension_count", rope_dims)):
        w.add_uint32(f"{ARCH}.{key}", value)
    w.add_float32(f"{ARCH}.rope.freq_base", rope_base)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", rms_eps)
    w.add_array(f"{ARCH}.attention.recurrent_layers", [kind == "r" for kind in pattern])
    w.add_file_type(int(LlamaFileType.ALL_F32))
    finish_tiny_gguf(w, tokens, types, merges, {name: (arr, None) for name, arr in tensors.items()})
    return {"arch": ARCH, "path": str(Path(path)), "vocab_size": vocab, "pattern": pattern, "seed": seed,
            "n_embd": n_embd, "eos_id": 2, "tensors": tensors}
