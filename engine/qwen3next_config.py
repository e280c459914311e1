"""GGUF metadata of `qwen3next` (Qwen3-Next: gated DeltaNet + gated attention + MoE) -> ModelConfig fields.

engine/config.py builds the fields every architecture shares; `qwen3next_overrides` returns what differs,
as keyword arguments for `dataclasses.replace`. The keys are those llama.cpp's converter writes
(conversion/qwen.py Qwen3NextModel) and llama.cpp reads (src/models/qwen3next.cpp):

    qwen3next.attention.recurrent_layers   per-layer bools (else every full_attention_interval-th layer
                                           is attention, the rest DeltaNet)
    qwen3next.ssm.conv_kernel              L of the causal conv1d before the delta rule
    qwen3next.ssm.state_size               key head dim dk
    qwen3next.ssm.group_count              key heads Hk
    qwen3next.ssm.time_step_rank           value heads Hv (a multiple of Hk)
    qwen3next.ssm.inner_size               Hv * dv
    qwen3next.expert_*                     routed experts (softmax -> top-k -> renormalised, as qwen3moe)
    qwen3next.expert_shared_feed_forward_length   the shared expert's F (sigmoid-gated)
    qwen3next.rope.dimension_count         rotated dims per head (partial RoPE, a quarter of head_dim)

MTP layers (`qwen3next.nextn_predict_layers` of them, counted in block_count, blk.N.* past the trunk) are
skipped as llama.cpp's main pass skips them: strata does not draft with them. Every variant we do not compute
(another gating function, grouped routing, no shared expert, RoPE scaling) fails here naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCH = "qwen3next"
_GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


@dataclass(frozen=True)
class DeltaNetShape:
    """The gated DeltaNet layers' sizes: Hk key heads of dk, Hv value heads of dv, conv length L."""

    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv1d: q | k | v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_floats(self) -> int:
        """One layer's state per sequence: L-1 conv rows and the [Hv, dk, dv] delta-rule matrix."""
        return (self.conv_kernel - 1) * self.conv_dim + self.n_v_heads * self.k_head_dim * self.v_head_dim


def qwen3next_overrides(fields: dict[str, Any], n_layers: int) -> dict:
    """ModelConfig fields for qwen3next from GGUF `fields`; ValueError names a missing or unsupported key."""
    key = lambda name: f"{ARCH}.{name}"  # noqa: E731

    def need(name: str) -> Any:
        if fields.get(key(name)) is None:
            raise ValueError(f"GGUF metadata is missing {key(name)} (required for {ARCH})")
        return fields[key(name)]

    _reject_variants(fields)
    n_layers -= int(fields.get(key("nextn_predict_layers"), 0) or 0)  # the MTP blocks come last
    if n_layers <= 0:
        raise ValueError(f"{key('nextn_predict_layers')} leaves no trunk layers of {key('block_count')}")
    n_k, n_v, dk = int(need("ssm.group_count")), int(need("ssm.time_step_rank")), int(need("ssm.state_size"))
    inner = int(need("ssm.inner_size"))
    if n_v % n_k or inner % n_v:
        raise ValueError(f"{key('ssm.time_step_rank')} = {n_v} must be a multiple of {key('ssm.group_count')} = "
                         f"{n_k}, and {key('ssm.inner_size')} = {inner} a multiple of it")
    conv = int(need("ssm.conv_kernel"))
    if conv < 2:
        raise ValueError(f"{key('ssm.conv_kernel')} = {conv}: a conv of length < 2 keeps no state")
    n_experts, n_used = int(need("expert_count")), int(need("expert_used_count"))
    if not 0 < n_used <= n_experts:
        raise ValueError(f"{key('expert_used_count')} = {n_used} must be in 1..{key('expert_count')} ({n_experts})")
    return dict(
        n_layers=n_layers,
        layer_is_sliding=(False,) * n_layers,
        layer_is_recurrent=_recurrent_layers(fields, n_layers),
        conv_kernel=conv,
        delta_net=DeltaNetShape(n_k, n_v, dk, inner // n_v, conv),
        n_experts=n_experts,
        n_experts_used=n_used,
        expert_ffn_dim=int(need("expert_feed_forward_length")),
        shared_expert_ffn_dim=int(need("expert_shared_feed_forward_length")),
        expert_gating="softmax",
        expert_weights_norm=True,  # llama.cpp's qwen3next graph always renormalises (HF norm_topk_prob)
        expert_activation="silu",
        has_qk_norm=True,
        has_attn_gate=True,
    )


def _recurrent_layers(fields: dict[str, Any], n_layers: int) -> tuple[bool, ...]:
    flags = fields.get(f"{ARCH}.attention.recurrent_layers")
    if flags is None:  # llama.cpp's fallback: every full_attention_interval-th layer is attention
        interval = int(fields.get(f"{ARCH}.full_attention_interval", 4))
        flags = [(i + 1) % interval != 0 for i in range(n_layers)]
    if not isinstance(flags, (list, tuple)) or len(flags) < n_layers:
        raise ValueError(f"{ARCH}.attention.recurrent_layers must list {n_layers} layers, got {flags!r}")
    flags = tuple(bool(f) for f in flags[:n_layers])  # entries past block_count belong to MTP layers
    if all(flags):
        raise ValueError(f"{ARCH}.attention.recurrent_layers has no attention layer")
    return flags


def _reject_variants(fields: dict[str, Any]) -> None:
    """Keys whose values describe a model we do not compute."""
    for name, allowed, what in (("expert_group_count", (0, 1), "grouped expert routing"),
                                ("expert_gating_func", (_GATING_SOFTMAX,), "expert gating other than softmax"),
                                ("leading_dense_block_count", (0,), "dense leading layers")):
        value = fields.get(f"{ARCH}.{name}")
        if value is not None and int(value) not in allowed:
            raise ValueError(f"{ARCH}.{name} = {value}: {what} is not supported for {ARCH}")
    norm = fields.get(f"{ARCH}.expert_weights_norm")
    if norm is not None and not norm:
        raise ValueError(f"{ARCH}.expert_weights_norm = false is not supported (llama.cpp renormalises always)")
    shared = fields.get(f"{ARCH}.expert_shared_feed_forward_length")
    if shared is not None and int(shared) <= 0:
        raise ValueError(f"{ARCH}.expert_shared_feed_forward_length = {shared}: a model without the shared "
                         "expert is not supported")
    scale = fields.get(f"{ARCH}.rope.scaling.type")
    if scale not in (None, "none"):
        raise ValueError(f"{ARCH}.rope.scaling.type = {scale!r} is not supported for {ARCH}")
