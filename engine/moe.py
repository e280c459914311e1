"""The mixture-of-experts FFN (qwen3moe, gpt-oss), written against the Backend protocol.

    h [T, d] --router--> logits [T, E] --route_experts--> ids [T, k], weights [T, k]
             --expert_ffn--> sum over the k chosen experts of weight * expert(h)            [T, d]

Routing (the backend's `route_experts`, config.expert_gating):
    "softmax"      qwen3moe: p = softmax(logits) over all E, keep the top k, optionally renormalise
                   them to sum to 1 (expert_weights_norm = norm_topk_prob)
    "softmax_topk" gpt-oss: keep the top k logits, softmax over those k only
then times expert_weights_scale. An expert is a gated FFN, down(act(gate_up(x))), with biases on gpt-oss.

`expert_ffn` groups the step's tokens by expert: a loop over the experts that received tokens, never
over tokens, so a token's cost is its k experts whatever the batch holds, and a decode step of B tokens
runs at most min(E, B k) small products per projection.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.backends.base import Array, Backend


@dataclass
class ExpertWeights:
    """One MoE layer: the router and E experts as per-expert linears over stacked storage.

    gate_up[e] is [2F, d] (gate rows, then up rows), down[e] is [d, F]; on numpy f32 they are views of
    one [E, 2F, d] / [E, d, F] array, on numpy quantized raw GGUF rows of the stacked tensors (the mmap).
    """

    router: Array  # [E, d] linear
    router_bias: Array | None  # [E] (gpt-oss)
    gate_up: list  # E linears [2F, d]
    down: list  # E linears [d, F]
    gate_up_bias: Array | None  # [E, 2F] (gpt-oss)
    down_bias: Array | None  # [E, d] (gpt-oss)
    device: object | None = None  # a backend's own stacked form (cuda: cuda.moe.CudaExperts); lists empty then

    @property
    def n_experts(self) -> int:
        return len(self.gate_up) or self.device.n_experts

    @property
    def nbytes(self) -> int:
        parts = [self.router, self.router_bias, self.gate_up_bias, self.down_bias, self.device, *self.gate_up,
                 *self.down]
        return sum(getattr(p, "nbytes", 0) for p in parts if p is not None)


def moe_ffn(b: Backend, h: Array, moe: ExpertWeights, config) -> Array:
    """The MoE FFN of one layer on the normed hidden rows h [T, d] -> [T, d]."""
    c = config
    logits = b.linear(h, moe.router, moe.router_bias)  # [T, E]
    ids, weights = b.route_experts(logits, c.n_experts_used, c.expert_gating, c.expert_weights_norm)
    if c.expert_weights_scale != 1.0:
        weights = weights * c.expert_weights_scale
    return b.expert_ffn(h, moe, ids, weights, c.expert_activation)  # [T, d]
