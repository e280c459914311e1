"""GGUF metadata of the mixture-of-experts architectures (qwen3moe, gpt-oss) -> ModelConfig fields.

engine/config.py builds the fields every architecture shares; `moe_overrides` returns what differs for
these two, as keyword arguments for `dataclasses.replace`. Each variant we do not implement (shared
experts, grouped routing, another gating function, a dense leading block, another RoPE scaling) fails
here at load with a ValueError naming the GGUF key, instead of computing something else quietly.

What llama.cpp does for each (src/models/qwen3moe.cpp, openai-moe.cpp) and transformers agrees with:

    qwen3moe   router softmax over all experts -> top-k -> renormalise the k weights (norm_topk_prob)
               SwiGLU experts, QK-norm attention, NeoX RoPE
    gpt-oss    router logits (+ bias) -> top-k -> softmax over the k; biased experts with the clamped
               SwiGLU (alpha 1.702, limit 7.0, (up + 1) * gate * sigmoid(alpha gate)); Q/K/V/O biases;
               a learned sink logit per head; even layers sliding-window, odd layers full; YaRN RoPE
"""
from __future__ import annotations

from typing import Any

MOE_ARCHITECTURES = ("qwen3moe", "gpt-oss")

# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values (gguf.ExpertGatingFuncType).
_GATING_SOFTMAX, _GATING_SIGMOID, _GATING_SOFTMAX_WEIGHT = 1, 2, 3
_GATING_BY_ARCH = {"qwen3moe": (_GATING_SOFTMAX, "softmax"), "gpt-oss": (_GATING_SOFTMAX_WEIGHT, "softmax_topk")}

# gpt-oss's SwiGLU constants: transformers GptOssConfig(swiglu_alpha=1.702, swiglu_limit=7.0) and
# llama.cpp's build_moe_ffn (LLM_FFN_SWIGLU_OAI_MOE) hard-code the same two numbers.
OAI_SWIGLU_ALPHA = 1.702
OAI_SWIGLU_LIMIT = 7.0
# llama.cpp's set_swa_pattern(2) for gpt-oss: layer i slides when i % 2 < 1.
GPT_OSS_SWA_PATTERN = 2
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's and transformers' defaults


def moe_overrides(arch: str, fields: dict[str, Any], n_layers: int) -> dict:
    """ModelConfig fields for a MoE architecture, read from GGUF `fields`; ValueError names a bad key."""
    key = lambda name: f"{arch}.{name}"  # noqa: E731

    def need(name: str) -> Any:
        if fields.get(key(name)) is None:
            raise ValueError(f"GGUF metadata is missing {key(name)} (required for {arch})")
        return fields[key(name)]

    _reject_variants(arch, fields)
    n_experts, n_used = int(need("expert_count")), int(need("expert_used_count"))
    if not 0 < n_used <= n_experts:
        raise ValueError(f"{key('expert_used_count')} = {n_used} must be in 1..{key('expert_count')} ({n_experts})")
    out = dict(
        n_experts=n_experts,
        n_experts_used=n_used,
        expert_ffn_dim=int(need("expert_feed_forward_length")),
        expert_weights_scale=float(fields.get(key("expert_weights_scale"), 1.0) or 1.0),
        expert_gating=_GATING_BY_ARCH[arch][1],
        **_yarn(arch, fields),  # gpt-oss always; Qwen3 long-context GGUFs may set it too
    )
    if arch == "qwen3moe":
        # llama.cpp always renormalises for qwen3moe; transformers' GGUF loader sets norm_topk_prob=True.
        out.update(expert_weights_norm=bool(fields.get(key("expert_weights_norm"), True)),
                   expert_activation="silu", has_qk_norm=True)
        return out
    window = int(need("attention.sliding_window"))
    pattern = int(fields.get(key("attention.sliding_window_pattern"), GPT_OSS_SWA_PATTERN))
    base = float(fields.get(key("rope.freq_base"), 10_000.0))
    out.update(
        expert_weights_norm=False,
        expert_activation="swiglu_oai",
        has_qkv_bias=True,
        has_attn_out_bias=True,
        has_attn_sinks=True,
        has_qk_norm=False,
        sliding_window=window,
        layer_is_sliding=tuple(i % pattern < pattern - 1 for i in range(n_layers)),
        rope_base_local=float(fields.get(key("rope.freq_base_swa"), base)),
    )
    return out


def _yarn(arch: str, fields: dict[str, Any]) -> dict:
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling in ("none", None):
        return {}
    if scaling != "yarn":
        raise ValueError(f"{arch}.rope.scaling.type = {scaling!r} is not supported for {arch} (only yarn or none)")
    attn_factor = float(fields.get(f"{arch}.rope.scaling.yarn_attn_factor", 1.0))
    if attn_factor != 1.0:
        raise ValueError(f"{arch}.rope.scaling.yarn_attn_factor = {attn_factor} is not supported (only 1.0)")
    orig = fields.get(f"{arch}.rope.scaling.original_context_length")
    if orig is None:
        raise ValueError(f"GGUF metadata is missing {arch}.rope.scaling.original_context_length (yarn)")
    return dict(
        rope_yarn_factor=float(fields.get(f"{arch}.rope.scaling.factor", 1.0)),
        rope_yarn_orig_ctx=int(orig),
        rope_yarn_beta_fast=float(fields.get(f"{arch}.rope.scaling.yarn_beta_fast", YARN_BETA_FAST)),
        rope_yarn_beta_slow=float(fields.get(f"{arch}.rope.scaling.yarn_beta_slow", YARN_BETA_SLOW)),
    )


def _reject_variants(arch: str, fields: dict[str, Any]) -> None:
    """Keys whose non-default values describe a model we do not compute."""
    allowed = [
        ("expert_shared_count", (0,), "shared experts"),
        ("expert_group_count", (0, 1), "grouped expert routing"),
        ("leading_dense_block_count", (0,), "dense leading layers"),
        ("interleave_moe_layer_step", (0, 1), "dense layers between MoE layers"),
    ]
    for name, values, what in allowed:
        value = fields.get(f"{arch}.{name}")
        if value is not None and value not in values:
            raise ValueError(f"{arch}.{name} = {value}: {what} are not supported for {arch}")
    gating = fields.get(f"{arch}.expert_gating_func")
    expected, name = _GATING_BY_ARCH[arch]
    if gating is not None and int(gating) != expected:
        raise ValueError(f"{arch}.expert_gating_func = {gating} is not supported for {arch} "
                         f"(only {expected}, {name})")
