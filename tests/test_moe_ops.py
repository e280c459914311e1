"""The numpy MoE ops one at a time: routing, the grouped expert FFN against a dense every-expert
computation, its cost (experts that got tokens only), gpt-oss's clamped SwiGLU and attention sinks."""
import numpy as np
import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.kv import layout_for
from engine.moe import ExpertWeights

RNG = np.random.default_rng(0)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_softmax_routing_takes_the_top_k_of_all_experts_and_renormalises():
    logits = np.array([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.25, 2.0]], dtype=np.float32)
    ids, weights = NumpyBackend().route_experts(logits, 2, "softmax", normalize=False)
    assert ids.tolist() == [[1, 2], [3, 0]]
    np.testing.assert_allclose(weights, np.take_along_axis(_softmax(logits), ids, 1), rtol=1e-6)
    _, normed = NumpyBackend().route_experts(logits, 2, "softmax", normalize=True)
    np.testing.assert_allclose(normed, weights / weights.sum(1, keepdims=True), rtol=1e-6)


def test_softmax_topk_routing_is_a_softmax_over_the_k_selected_logits_only():
    logits = np.array([[1.0, 3.0, 2.0, 0.0]], dtype=np.float32)
    ids, weights = NumpyBackend().route_experts(logits, 2, "softmax_topk", normalize=False)
    assert ids.tolist() == [[1, 2]]
    np.testing.assert_allclose(weights[0], _softmax(np.array([3.0, 2.0])), rtol=1e-6)


def _experts(n_experts=6, d=16, ff=8, biased=True):
    gate_up = (RNG.standard_normal((n_experts, 2 * ff, d)) * 0.8).astype(np.float32)
    down = (RNG.standard_normal((n_experts, d, ff)) * 0.3).astype(np.float32)
    bias = lambda *s: (RNG.standard_normal(s) * 0.5).astype(np.float32) if biased else None  # noqa: E731
    return ExpertWeights(router=None, router_bias=None, gate_up=list(gate_up), down=list(down),
                         gate_up_bias=bias(n_experts, 2 * ff), down_bias=bias(n_experts, d))


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_grouped_expert_ffn_equals_every_expert_on_every_token_masked(activation):
    b, moe = NumpyBackend(), _experts(biased=activation == "swiglu_oai")
    h = RNG.standard_normal((11, 16)).astype(np.float32) * 3
    ids = np.stack([RNG.choice(6, size=3, replace=False) for _ in range(11)])  # [T, k], distinct per token
    weights = RNG.random((11, 3)).astype(np.float32)
    expected = np.zeros_like(h)
    for e in range(6):  # dense: expert e on all rows, times the weight it has for each row (0 if unchosen)
        gu = h @ moe.gate_up[e].T + (0 if moe.gate_up_bias is None else moe.gate_up_bias[e])
        y = b.gated_activation(gu, activation) @ moe.down[e].T + (0 if moe.down_bias is None else moe.down_bias[e])
        expected += y * ((ids == e) * weights).sum(1, keepdims=True)
    np.testing.assert_allclose(b.expert_ffn(h, moe, ids, weights, activation), expected, rtol=1e-5, atol=1e-5)


class _CountingBackend(NumpyBackend):
    def __init__(self):
        self.linear_rows = []

    def linear(self, x, weight, bias=None):
        self.linear_rows.append(x.shape[0])
        return super().linear(x, weight, bias)


def test_a_step_computes_only_the_experts_its_tokens_chose_on_only_their_rows():
    b, moe = _CountingBackend(), _experts()
    h = RNG.standard_normal((4, 16)).astype(np.float32)
    ids = np.array([[0, 5], [5, 2], [0, 5], [2, 0]])
    b.expert_ffn(h, moe, ids, np.ones((4, 2), np.float32), "silu")
    # experts 0, 2, 5 got 3, 2, 3 tokens: one gate_up and one down product each, never experts 1, 3, 4
    assert b.linear_rows == [3, 3, 2, 2, 3, 3]
    b.linear_rows.clear()
    b.expert_ffn(h[:1], moe, ids[:1], np.ones((1, 2), np.float32), "silu")
    assert b.linear_rows == [1, 1, 1, 1]  # one token costs its k experts


def test_swiglu_oai_is_transformers_clamped_formula():
    gate_up = np.linspace(-20, 20, 2 * 41, dtype=np.float32).reshape(1, -1)
    gate, up = gate_up[:, :41], gate_up[:, 41:][:, ::-1].copy()
    got = NumpyBackend().gated_activation(np.concatenate([gate, up], axis=1), "swiglu_oai")
    g, u = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)  # GptOssExperts._apply_gate, alpha 1.702
    np.testing.assert_allclose(got, (u + 1) * g * (1 / (1 + np.exp(-g * 1.702))), rtol=1e-6, atol=1e-6)


def _pool_with_keys(n_tokens, n_kv=2, hd=8):
    layout = layout_for(type("C", (), {"n_layers": 1, "n_kv_layers": 1, "n_kv_heads": n_kv, "head_dim": hd})(), 8, 4)
    pool = NumpyBackend().create_kv_pool(layout)
    k = RNG.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
    v = RNG.standard_normal((n_tokens, n_kv, hd)).astype(np.float32)
    batch = build_batch([(list(range(n_tokens)), 0, np.array([3, 1, 6, 7, 0]))], 4)  # two key runs
    NumpyBackend().store_kv(pool, 0, k, v, batch)
    return pool, batch, k, v


def test_attention_sinks_join_each_softmax_denominator_with_no_value():
    pool, batch, k, v = _pool_with_keys(10)
    q = RNG.standard_normal((10, 4, 8)).astype(np.float32)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32)
    got = NumpyBackend().attention(q, pool, 0, batch, 0.35, window=0, sinks=sinks).reshape(10, 4, 8)
    for h in range(4):
        scores = q[:, h] @ k[:, h // 2].T * 0.35
        scores = np.where(np.tril(np.ones((10, 10), bool)), scores, -np.inf)
        probs = _softmax(np.concatenate([scores, np.full((10, 1), sinks[h])], axis=1))[:, :-1]
        np.testing.assert_allclose(got[:, h], probs @ v[:, h // 2], rtol=1e-5, atol=1e-6)
