"""Write tiny random-weight mixture-of-experts GGUFs (``qwen3moe``, ``gpt-oss``) for tests.

The tensor names and metadata keys are the ones llama.cpp's ``convert_hf_to_gguf.py`` writes for these
architectures (Qwen3MoeModel, GptOssModel), so transformers' GGUF loader and llama.cpp read them like
real checkpoints; the tokenizer is tests/support/tiny_gguf.py's byte-level BPE.

Stacked expert tensors, numpy order (GGUF stores the dims reversed):

    ffn_gate_inp   [E, d]        router (gpt-oss: + bias [E])
    ffn_gate_exps  [E, F, d]     per-expert gate rows (gpt-oss: + bias [E, F])
    ffn_up_exps    [E, F, d]     per-expert up rows   (gpt-oss: + bias [E, F])
    ffn_down_exps  [E, d, F]     per-expert down rows (gpt-oss: + bias [E, d])

gpt-oss also has biases on Q/K/V/O, one attention-sink logit per head (``attn_sinks`` [H]), its FFN norm
under the name ``post_attention_norm``, sliding-window layers alternating with full ones (even layers
slide), YaRN RoPE metadata, and an untied output head. ``expert_quant='MXFP4'`` stores the three expert
tensors as MXFP4 blocks, as the released gpt-oss GGUFs do; everything 2-D uses ``quant``.

Deterministic: the same arguments and seed always give the same bytes (the reference script regenerates
the file in CI from the seed and compares against committed logits).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import LlamaFileType

from tests.support.tiny_gguf import CHATML_TEMPLATE, add_extra_metadata, encode_tensor, finish_tiny_gguf, tiny_vocab

MOE_ARCHS = ("qwen3moe", "gpt-oss")
# gpt-oss's harmony control tokens (o200k_harmony), appended to the tiny vocabulary with harmony=True.
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
# A reduced harmony template (the real one adds dates, reasoning effort and TypeScript tool signatures):
# messages as <|start|>role<|message|>..<|end|>, the tools in a developer message, tool calls and results
# in the commentary channel, generation opened with <|start|>assistant.
HARMONY_TEMPLATE = (
    "{%- if tools -%}<|start|>developer<|message|># Tools\n{{ tools | tojson }}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}{%- for tc in m.tool_calls -%}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>json<|message|>"
    "{{ tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson }}<|call|>"
    "{%- endfor -%}"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
EXPERT_QUANTS = ("F32", "F16", "Q8_0", "MXFP4")

_DEFAULTS = {
    #             layers ctx  rope_base   eps   tied
    "qwen3moe": (3, 256, 1_000_000.0, 1e-6, True),
    "gpt-oss": (4, 256, 150_000.0, 1e-5, False),
}


def write_tiny_moe_gguf(path, arch: str, seed: int = 0, **overrides) -> dict:
    """Write a tiny random-weight MoE GGUF for ``arch`` to ``path``; returns its shape and tensors.

    Overrides: ``n_embd`` (64), ``n_layer`` (qwen3moe 3, gpt-oss 4), ``n_head`` (4), ``n_head_kv`` (2),
    ``head_dim`` (16), ``n_expert`` (8), ``n_expert_used`` (2), ``n_ff_exp`` (32), ``n_ctx`` (256),
    ``rope_base``, ``rms_eps``, ``tied``, ``quant`` ('F32') for attention / head matrices,
    ``expert_quant`` ('F32'; one of EXPERT_QUANTS), ``router_scale`` (1.0, std of router weights: large
    enough that routing is decisive), ``weight_scale`` (0.2), ``expert_scale`` (= weight_scale; gpt-oss
    tests use 0.6 so its SwiGLU clamp at 7.0 is reached), ``embd_scale`` (0.1), ``norm_scale`` (0.1),
    gpt-oss only: ``sliding_window`` (8), ``yarn_factor`` (4.0), ``yarn_orig_ctx`` (64), ``sink_scale``
    (1.0), ``fused_gate_up`` (False: one ffn_gate_up_exps tensor instead of gate and up, same values),
    ``hot_experts`` (0; N: experts 0..N-1 get +4 router bias, a hot set),
    ``harmony`` (False: add HARMONY_TOKENS as control tokens, <|return|> as EOS and
    HARMONY_TEMPLATE); ``chat_template`` (ChatML, or HARMONY_TEMPLATE), ``extra_metadata`` ({key: value}, int -> uint32, float -> float32,
    bool, str; keys written verbatim, for tests of unsupported variants).
    """
    if arch not in MOE_ARCHS:
        raise ValueError(f"arch must be one of {MOE_ARCHS}, got {arch!r}")
    d_layers, d_ctx, d_base, d_eps, d_tied = _DEFAULTS[arch]
    o = dict(overrides)
    n_embd, n_layer = o.pop("n_embd", 64), o.pop("n_layer", d_layers)
    n_head, n_head_kv, head_dim = o.pop("n_head", 4), o.pop("n_head_kv", 2), o.pop("head_dim", 16)
    n_expert, n_used, n_ff_exp = o.pop("n_expert", 8), o.pop("n_expert_used", 2), o.pop("n_ff_exp", 32)
    n_ctx = o.pop("n_ctx", d_ctx)
    rope_base, rms_eps = float(o.pop("rope_base", d_base)), float(o.pop("rms_eps", d_eps))
    tied = bool(o.pop("tied", d_tied))
    quant, expert_quant = o.pop("quant", "F32"), o.pop("expert_quant", "F32")
    rscale, wscale = o.pop("router_scale", 1.0), o.pop("weight_scale", 0.2)
    xscale = o.pop("expert_scale", wscale)
    escale, nscale = o.pop("embd_scale", 0.1), o.pop("norm_scale", 0.1)
    is_oss = arch == "gpt-oss"
    sliding_window = o.pop("sliding_window", 8) if is_oss else None
    yarn_factor = float(o.pop("yarn_factor", 4.0)) if is_oss else None
    yarn_orig_ctx = int(o.pop("yarn_orig_ctx", 64)) if is_oss else None
    sink_scale = o.pop("sink_scale", 1.0) if is_oss else None
    harmony = bool(o.pop("harmony", False))
    fused_gate_up = bool(o.pop("fused_gate_up", False))
    hot_experts = int(o.pop("hot_experts", 0)) if is_oss else 0  # router bias +4 on experts 0..hot-1
    chat_template = o.pop("chat_template", HARMONY_TEMPLATE if harmony else CHATML_TEMPLATE)
    extra = o.pop("extra_metadata", {})
    if o:
        raise TypeError(f"unknown overrides: {sorted(o)}")
    if expert_quant not in EXPERT_QUANTS:
        raise ValueError(f"expert_quant {expert_quant!r}: use one of {EXPERT_QUANTS}")
    if is_oss and tied:
        raise ValueError("gpt-oss always has an output.weight (llama.cpp requires it)")

    tokens, types, merges = tiny_vocab()
    if harmony:
        tokens, types = tokens + HARMONY_TOKENS, types + [3] * len(HARMONY_TOKENS)
    eos_id = tokens.index("<|return|>") if harmony else 2
    rng = np.random.default_rng(seed)

    def mat(*shape, scale=wscale) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * nscale).astype(np.float32)

    t: dict[str, np.ndarray] = {"token_embd.weight": mat(len(tokens), n_embd, scale=escale)}
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(n_embd)
        t[p + "attn_q.weight"], t[p + "attn_k.weight"] = mat(q_dim, n_embd), mat(kv_dim, n_embd)
        t[p + "attn_v.weight"] = mat(kv_dim, n_embd)
        if is_oss:
            t[p + "attn_q.bias"], t[p + "attn_k.bias"] = mat(q_dim, scale=0.1), mat(kv_dim, scale=0.1)
            t[p + "attn_v.bias"] = mat(kv_dim, scale=0.1)
            t[p + "attn_sinks.weight"] = mat(n_head, scale=sink_scale)
        else:
            t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"] = norm(head_dim), norm(head_dim)
        t[p + "attn_output.weight"] = mat(n_embd, q_dim)
        if is_oss:
            t[p + "attn_output.bias"] = mat(n_embd, scale=0.1)
        t[p + ("post_attention_norm.weight" if is_oss else "ffn_norm.weight")] = norm(n_embd)
        t[p + "ffn_gate_inp.weight"] = mat(n_expert, n_embd, scale=rscale)
        t[p + "ffn_gate_exps.weight"] = mat(n_expert, n_ff_exp, n_embd, scale=xscale)
        t[p + "ffn_up_exps.weight"] = mat(n_expert, n_ff_exp, n_embd, scale=xscale)
        t[p + "ffn_down_exps.weight"] = mat(n_expert, n_embd, n_ff_exp, scale=xscale)
        if is_oss:
            t[p + "ffn_gate_inp.bias"] = mat(n_expert, scale=0.1)
            t[p + "ffn_gate_inp.bias"][:hot_experts] += 4.0  # a hot set (scripts/bench_moe.py's expert cache)
            t[p + "ffn_gate_exps.bias"] = mat(n_expert, n_ff_exp, scale=0.1)
            t[p + "ffn_up_exps.bias"] = mat(n_expert, n_ff_exp, scale=0.1)
            t[p + "ffn_down_exps.bias"] = mat(n_expert, n_embd, scale=0.1)
    if fused_gate_up:  # newer converters' --fuse-gate-up-exps: [E, 2F, d], gate rows first (bias [E, 2F])
        for i in range(n_layer):
            p = f"blk.{i}."
            for suffix, axis in ((".weight", 1), (".bias", 1)):
                gate, up = p + "ffn_gate_exps" + suffix, p + "ffn_up_exps" + suffix
                if gate in t:
                    t[p + "ffn_gate_up_exps" + suffix] = np.concatenate([t.pop(gate), t.pop(up)], axis=axis)
    t["output_norm.weight"] = norm(n_embd)
    if not tied:
        t["output.weight"] = mat(len(tokens), n_embd)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    # The converters write intermediate_size here: gpt-oss's is the expert width, Qwen3-MoE's a dense
    # width no layer uses; every layer of both is a MoE layer.
    w.add_feed_forward_length(n_ff_exp if is_oss else 4 * n_ff_exp)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    if is_oss:
        w.add_sliding_window(sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn_factor)
        w.add_rope_scaling_orig_ctx_len(yarn_orig_ctx)
    w.add_file_type(int(LlamaFileType.ALL_F32 if quant == "F32" else LlamaFileType[f"MOSTLY_{quant}"]))
    add_extra_metadata(w, extra)

    def qname(name: str, arr: np.ndarray) -> str:
        if "_exps.weight" in name:
            return expert_quant
        if arr.ndim == 2 and name not in ("token_embd.weight",) and "ffn_gate_inp" not in name:
            return quant
        return "F32"  # norms, biases, sinks, the router and the token table stay F32, as converted
    finish_tiny_gguf(w, tokens, types, merges, {n: encode_tensor(a, qname(n, a)) for n, a in t.items()}, chat_template,
                     eos_id=eos_id)
    return {
        "arch": arch, "path": str(Path(path)), "vocab_size": len(tokens), "n_embd": n_embd,
        "n_layer": n_layer, "n_head": n_head, "n_head_kv": n_head_kv, "head_dim": head_dim,
        "n_expert": n_expert, "n_expert_used": n_used, "n_ff_exp": n_ff_exp, "n_ctx": n_ctx,
        "rope_base": rope_base, "rms_eps": rms_eps, "sliding_window": sliding_window,
        "yarn_factor": yarn_factor, "yarn_orig_ctx": yarn_orig_ctx, "tied": tied, "quant": quant,
        "expert_quant": expert_quant, "tokens": tokens, "tensors": t,
    }
