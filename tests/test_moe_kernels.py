"""The MoE CUDA kernels (cuda_kernels/moe.cu) against the numpy MoE ops, on the CPU emulator (and on a GPU
where there is one): routing, the grouped expert matvec for every weight type, the gpt-oss activation, the
combine, and the whole chain route -> group -> gate_up -> act -> down -> combine == numpy_moe.expert_ffn."""
import numpy as np
import pytest

from cuda_kernels.moe import plan_groups
from cuda_kernels.quant_types import QUANT_TYPES
from engine.backends.reference import moe as numpy_moe
from engine.backends.reference.backend import NumpyBackend
from engine.moe import ExpertWeights
from tests.support.cuda_helpers import random_weight

GATING = {"softmax": 0, "softmax_topk": 1}


def _route(runner, logits, k, gating, normalize):
    T, E = logits.shape
    ids = np.full((T, k), -1, dtype=np.int32)
    weights = np.full((T, k), np.nan, dtype=np.float32)
    runner.launch("moe_route_f32", ids=ids, weights=weights, logits=np.ascontiguousarray(logits), T=T, E=E, k=k,
                  gating=GATING[gating], normalize=int(normalize))
    return ids, weights


@pytest.mark.parametrize("E, k", [(8, 2), (40, 4), (128, 8), (256, 16)])
@pytest.mark.parametrize("gating, normalize", [("softmax", True), ("softmax", False), ("softmax_topk", False)])
def test_route_kernel_equals_numpy_routing(kernel_runner, E, k, gating, normalize):
    rng = np.random.default_rng(E + k)
    logits = (rng.standard_normal((37, E)) * 3).astype(np.float32)  # 37 rows: a partial CTA
    logits[5, :] = np.round(logits[5, :])  # ties: the lower expert id wins, as numpy's stable sort
    ids, weights = _route(kernel_runner("moe"), logits, k, gating, normalize)
    want_ids, want_weights = numpy_moe.route_experts(logits, k, gating, normalize)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-7)


def test_plan_groups_sorts_pairs_by_expert_and_splits_groups_of_eight():
    ids = np.array([[3, 1]] * 10 + [[1, 0]], dtype=np.int32)  # expert 3: 10 pairs -> groups of 8 and 2
    plan = plan_groups(ids)
    assert plan["group_expert"].tolist() == [0, 1, 1, 3, 3]
    assert plan["group_len"].tolist() == [1, 8, 3, 8, 2] and plan["group_start"].tolist() == [0, 1, 9, 12, 20]
    sorted_experts = ids.reshape(-1)[np.argsort(ids.reshape(-1), kind="stable")]
    assert (ids.reshape(-1)[plan["pair_of"].argsort()] == sorted_experts).all()
    assert plan["pair_rows"].tolist()[:3] == [10, 0, 1]  # expert 0's pair (token 10), then expert 1's by token


def _stacked(type_name, n_experts, out, in_dim, rng):
    parts = [random_weight(type_name, out, in_dim, rng) for _ in range(n_experts)]
    raw = np.ascontiguousarray(np.stack([p[0] for p in parts]))  # [E, out, row_bytes]: the GGUF stacking
    return raw, np.stack([p[1] for p in parts])  # [E, out, in] float64


def _grouped_matvec(runner, suffix, raw, x, ids, bias, out, in_dim):
    plan = plan_groups(ids)
    n_pairs, ld_y = ids.size, out + 3
    y = np.full((n_pairs, ld_y), np.nan, dtype=np.float32)
    runner.launch(f"moe_matvec_{suffix}", y=y, W=raw.reshape(-1), expert_ptr=None, x=np.ascontiguousarray(x),
                  bias=bias,
                  group_expert=plan["group_expert"], group_start=plan["group_start"], group_len=plan["group_len"],
                  pair_rows=plan["pair_rows"], n_groups=len(plan["group_len"]), out=out, ld_y=ld_y, **{"in": in_dim})
    assert np.isnan(y[:, out:]).all(), "wrote past its out columns"
    return y[:, :out], plan


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_grouped_matvec_is_each_pairs_expert_times_its_token(kernel_runner, type_name):
    rng = np.random.default_rng(7)
    n_experts, out, in_dim, T, k = 5, 40, 256, 13, 3  # 40 rows: a partial CTA; expert 0 gets > 8 pairs
    raw, dense = _stacked(type_name, n_experts, out, in_dim, rng)
    x = rng.standard_normal((T, in_dim)).astype(np.float32)
    ids = np.stack([np.concatenate([[0], rng.choice(np.arange(1, n_experts), size=k - 1, replace=False)])
                    for _ in range(T)]).astype(np.int32)
    bias = rng.standard_normal((n_experts, out)).astype(np.float32)
    y, plan = _grouped_matvec(kernel_runner("moe"), QUANT_TYPES[type_name].suffix, raw, x, ids, bias, out, in_dim)
    assert max(plan["group_len"]) == 8 and list(plan["group_expert"]).count(0) == 2  # 13 pairs: split in two
    flat = ids.reshape(-1)
    for pair in range(ids.size):
        p = plan["pair_of"][pair]  # sorted row of (token pair // k, slot pair % k)
        want = dense[flat[pair]] @ x[pair // k].astype(np.float64) + bias[flat[pair]]
        np.testing.assert_allclose(y[p], want, rtol=1e-4, atol=1e-4)


def test_swiglu_oai_and_combine_kernels_equal_numpy(kernel_runner):
    rng = np.random.default_rng(3)
    runner = kernel_runner("moe")
    gate_up = (rng.standard_normal((9, 2 * 24)) * 6).astype(np.float32)
    act = np.full((9, 24), np.nan, dtype=np.float32)
    runner.launch("gated_swiglu_oai_f32", out=act, gate_up=gate_up, T=9, F=24)
    np.testing.assert_allclose(act, NumpyBackend().gated_activation(gate_up, "swiglu_oai"), rtol=1e-5, atol=1e-6)
    ids = rng.integers(0, 6, size=(7, 2)).astype(np.int32)
    ids[:, 1] = (ids[:, 0] + 1) % 6
    plan, weights = plan_groups(ids), rng.random((7, 2)).astype(np.float32)
    y = rng.standard_normal((14, 10)).astype(np.float32)
    out = np.full((7, 10), np.nan, dtype=np.float32)
    runner.launch("moe_combine_f32", out=out, y=y, pair_of=plan["pair_of"], weights=weights, T=7, k=2, d=10)
    want = (weights[:, :, None] * y[plan["pair_of"].reshape(7, 2)]).sum(1)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_the_kernel_chain_equals_the_numpy_expert_ffn(kernel_runner, activation):
    """route -> plan -> gate_up (grouped) -> act -> down (grouped) -> combine, on f32 expert weights."""
    rng = np.random.default_rng(11)
    runner, T, d, ff, E, k = kernel_runner("moe"), 6, 64, 32, 8, 2
    h = rng.standard_normal((T, d)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    gate_up = (rng.standard_normal((E, 2 * ff, d)) * 0.3).astype(np.float32)
    down = (rng.standard_normal((E, d, ff)) * 0.3).astype(np.float32)
    gu_bias, down_bias = rng.standard_normal((E, 2 * ff)).astype(np.float32), rng.standard_normal((E, d)).astype(np.float32)
    gating = "softmax_topk" if activation == "swiglu_oai" else "softmax"
    ids, weights = _route(runner, logits, k, gating, normalize=True)
    y_gu, plan = _grouped_matvec(runner, "f32", gate_up.view(np.uint8), h, ids, gu_bias, 2 * ff, d)
    act = np.empty((T * k, ff), dtype=np.float32)
    if activation == "silu":  # elementwise.cu's kernel, the one the dense models use
        kernel_runner("elementwise").launch("gated_silu_f32", out=act, gate_up=np.ascontiguousarray(y_gu), T=T * k, F=ff)
    else:
        runner.launch("gated_swiglu_oai_f32", out=act, gate_up=np.ascontiguousarray(y_gu), T=T * k, F=ff)
    # down: the pairs are already in sorted order, so each pair's row is its own x row
    plan_down = dict(plan, pair_rows=np.arange(T * k, dtype=np.int32))
    y_down = np.full((T * k, d), np.nan, dtype=np.float32)
    runner.launch("moe_matvec_f32", y=y_down, W=down.view(np.uint8).reshape(-1), expert_ptr=None, x=act,
                  bias=down_bias,
                  group_expert=plan_down["group_expert"], group_start=plan_down["group_start"],
                  group_len=plan_down["group_len"], pair_rows=plan_down["pair_rows"],
                  n_groups=len(plan_down["group_len"]), out=d, ld_y=d, **{"in": ff})
    out = np.empty((T, d), dtype=np.float32)
    runner.launch("moe_combine_f32", out=out, y=y_down, pair_of=plan["pair_of"], weights=weights, T=T, k=k, d=d)
    moe = ExpertWeights(None, None, list(gate_up), list(down), gu_bias, down_bias)
    want_ids, want_weights = numpy_moe.route_experts(logits, k, gating, True)
    want = numpy_moe.expert_ffn(NumpyBackend(), h, moe, want_ids, want_weights, activation)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T, k, E, group_rows", [(1, 2, 8, 8), (13, 3, 5, 8), (64, 8, 128, 8), (40, 4, 256, 8),
                                                 (70, 2, 3, 64), (64, 8, 128, 64)])
def test_device_plan_equals_the_host_plan_and_zeroes_spare_groups(kernel_runner, T, k, E, group_rows):
    from cuda_kernels.moe import max_groups

    rng = np.random.default_rng(T * k)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    ids[: T // 2, 0] = 0  # a popular expert: several groups of 8
    n, spare = T * k, max_groups(T * k, E, group_rows)
    got = {name: np.full(size, -7, dtype=np.int32) for name, size in (
        ("pair_rows", n), ("pair_of", n), ("group_expert", spare), ("group_start", spare), ("group_len", spare))}
    kernel_runner("moe").launch("moe_plan", ids=ids, n_pairs=n, k=k, E=E, max_groups=spare, group_rows=group_rows,
                                **got)
    want = plan_groups(ids, group_rows)
    used = len(want["group_len"])
    for name in ("pair_rows", "pair_of"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in ("group_expert", "group_start", "group_len"):
        np.testing.assert_array_equal(got[name][:used], want[name], err_msg=name)
    assert (got["group_len"][used:] == 0).all()


def test_grouped_matvec_skips_empty_groups(kernel_runner):
    rng = np.random.default_rng(5)
    raw, dense = _stacked("Q8_0", 3, 16, 64, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    y = np.full((2, 16), np.nan, dtype=np.float32)
    kernel_runner("moe").launch("moe_matvec_q8_0", y=y, W=raw.reshape(-1), expert_ptr=None, x=x, bias=None,
                                group_expert=np.array([2, 0], np.int32), group_start=np.array([0, 0], np.int32),
                                group_len=np.array([2, 0], np.int32), pair_rows=np.array([1, 0], np.int32),
                                n_groups=2, out=16, ld_y=16, **{"in": 64})
    np.testing.assert_allclose(y, x[[1, 0]].astype(np.float64) @ dense[2].T, rtol=1e-4, atol=1e-4)


def test_grouped_matvec_without_pair_rows_reads_x_in_pair_order(kernel_runner):
    rng = np.random.default_rng(6)
    raw, dense = _stacked("F32", 2, 8, 32, rng)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    y = np.full((3, 8), np.nan, dtype=np.float32)
    kernel_runner("moe").launch("moe_matvec_f32", y=y, W=raw.reshape(-1), expert_ptr=None, x=x, bias=None,
                                group_expert=np.array([1, 0], np.int32), group_start=np.array([0, 2], np.int32),
                                group_len=np.array([2, 1], np.int32), pair_rows=None, n_groups=2, out=8, ld_y=8,
                                **{"in": 32})
    want = np.concatenate([x[:2].astype(np.float64) @ dense[1].T, x[2:].astype(np.float64) @ dense[0].T])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
