"""The grouped expert gemm (moe_gemm_<q>, moe.cu on gemm_tiles.cuh) on the CPU emulator (and a GPU where there is
one): every weight type against the GGUF-dequantised product of each pair's expert, groups of up to 64 pairs, the
expert cache's slot table (expert_ptr) giving the same bits as the stacked layout, and the prefill chain
route -> plan(64) -> moe_gemm gate_up -> act -> moe_gemm down -> combine == numpy_moe.expert_ffn."""
import numpy as np
import pytest

from cuda_kernels.moe import MOE_GEMM_GROUP_ROWS, plan_groups
from cuda_kernels.quant_types import QUANT_TYPES
from engine.backends.reference import moe as numpy_moe
from engine.backends.reference.backend import NumpyBackend
from engine.moe import ExpertWeights
from tests.support.cuda_helpers import random_weight
from tests.support.kernel_emulator import EmulatedSource


def _stacked(type_name, n_experts, out, in_dim, rng):
    parts = [random_weight(type_name, out, in_dim, rng) for _ in range(n_experts)]
    return np.ascontiguousarray(np.stack([p[0] for p in parts])), np.stack([p[1] for p in parts])


def _grouped(runner, kernel, raw, x, plan, bias, out, in_dim, expert_ptr=None, pair_rows=True):
    n_pairs, ld_y = len(plan["pair_of"]), out + 3
    y = np.full((n_pairs, ld_y), np.nan, dtype=np.float32)
    runner.launch(kernel, y=y, W=None if expert_ptr is not None else raw.reshape(-1), expert_ptr=expert_ptr,
                  x=np.ascontiguousarray(x), bias=bias, group_expert=plan["group_expert"],
                  group_start=plan["group_start"], group_len=plan["group_len"],
                  pair_rows=plan["pair_rows"] if pair_rows else None, n_groups=len(plan["group_len"]), out=out,
                  ld_y=ld_y, **{"in": in_dim})
    assert np.isnan(y[:, out:]).all(), "wrote past its out columns"
    return y[:, :out]


def _ids(rng, T, k, n_experts, popular=0):
    """[T, k] distinct experts per token; every token also picks `popular` (so it gets > 64 pairs at T > 64)."""
    rest = np.arange(n_experts) != popular
    return np.stack([np.concatenate([[popular], rng.choice(np.arange(n_experts)[rest], size=k - 1, replace=False)])
                     for _ in range(T)]).astype(np.int32)


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_grouped_gemm_is_each_pairs_expert_times_its_token(kernel_runner, type_name):
    rng = np.random.default_rng(17)
    n_experts, out, in_dim, T, k = 4, 72, 256, 70, 2  # 72 rows: a partial tile; expert 0: 70 pairs = 64 + 6
    raw, dense = _stacked(type_name, n_experts, out, in_dim, rng)
    x = rng.standard_normal((T, in_dim)).astype(np.float32)
    ids = _ids(rng, T, k, n_experts)
    bias = rng.standard_normal((n_experts, out)).astype(np.float32)
    plan = plan_groups(ids, MOE_GEMM_GROUP_ROWS)
    assert list(plan["group_expert"]).count(0) == 2 and max(plan["group_len"]) == 64
    y = _grouped(kernel_runner("moe"), f"moe_gemm_{QUANT_TYPES[type_name].suffix}", raw, x, plan, bias, out, in_dim)
    flat = ids.reshape(-1)
    want = np.empty_like(y, dtype=np.float64)
    for pair in range(ids.size):
        want[plan["pair_of"][pair]] = dense[flat[pair]] @ x[pair // k].astype(np.float64) + bias[flat[pair]]
    rel_err = np.linalg.norm(y - want) / np.linalg.norm(want)
    assert rel_err < 1e-2, f"moe_gemm_{type_name}: relative error {rel_err:.2e}"  # fp16 tiles, as gemm_<q>


def test_grouped_gemm_skips_empty_groups_and_reads_x_in_pair_order_without_pair_rows(kernel_runner):
    rng = np.random.default_rng(5)
    raw, dense = _stacked("Q8_0", 3, 16, 64, rng)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    plan = {"group_expert": np.array([2, 0, 1], np.int32), "group_start": np.array([0, 0, 2], np.int32),
            "group_len": np.array([2, 0, 1], np.int32), "pair_rows": None, "pair_of": np.arange(3)}
    y = _grouped(kernel_runner("moe"), "moe_gemm_q8_0", raw, x, plan, None, 16, 64, pair_rows=False)
    want = np.concatenate([x[:2].astype(np.float64) @ dense[2].T, x[2:].astype(np.float64) @ dense[1].T])
    np.testing.assert_allclose(y, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernel", ["moe_matvec_q4_k", "moe_gemm_q4_k", "moe_gemm_mxfp4"])
def test_the_slot_table_gives_the_stacked_layouts_bits(kernel_runner, kernel):
    """Experts copied into shuffled slots of another buffer, read through expert_ptr: the same bits as W."""
    runner = kernel_runner("moe")
    if not isinstance(runner, EmulatedSource):
        pytest.skip("the slot table holds host addresses here; the GPU path is tests/test_cuda_expert_cache.py")
    rng = np.random.default_rng(9)
    type_name = "MXFP4" if kernel.endswith("mxfp4") else "Q4_K"
    n_experts, out, in_dim, T, k = 5, 40, 256, 12, 2
    raw, _ = _stacked(type_name, n_experts, out, in_dim, rng)
    slot_of = rng.permutation(n_experts + 2)[:n_experts]  # 7 slots, 5 used, in a shuffled order
    slots = np.zeros((n_experts + 2, raw[0].nbytes), dtype=np.uint8)
    slots[slot_of] = raw.reshape(n_experts, -1)
    expert_ptr = (slots.ctypes.data + slot_of * slots.shape[1]).astype(np.uint64)
    x = rng.standard_normal((T, in_dim)).astype(np.float32)
    ids = _ids(rng, T, k, n_experts)
    plan = plan_groups(ids, 8 if "matvec" in kernel else MOE_GEMM_GROUP_ROWS)
    stacked = _grouped(runner, kernel, raw, x, plan, None, out, in_dim)
    through_slots = _grouped(runner, kernel, raw, x, plan, None, out, in_dim, expert_ptr=expert_ptr)
    np.testing.assert_array_equal(through_slots, stacked)


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_the_prefill_kernel_chain_equals_the_numpy_expert_ffn(kernel_runner, activation):
    """route -> moe_plan(64) -> gate_up (moe_gemm) -> act -> down (moe_gemm) -> combine, Q8_0 experts."""
    rng = np.random.default_rng(11)
    runner, T, d, ff, E, k = kernel_runner("moe"), 40, 64, 32, 4, 2
    h = rng.standard_normal((T, d)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    raw_gu, dense_gu = _stacked("Q8_0", E, 2 * ff, d, rng)
    raw_down, dense_down = _stacked("Q8_0", E, d, ff, rng)
    gu_bias = rng.standard_normal((E, 2 * ff)).astype(np.float32)
    down_bias = rng.standard_normal((E, d)).astype(np.float32)
    gating = "softmax_topk" if activation == "swiglu_oai" else "softmax"
    ids, weights = numpy_moe.route_experts(logits, k, gating, True)
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    n = T * k
    plan = {name: np.full(size, -1, np.int32) for name, size in (("pair_rows", n), ("pair_of", n),
            ("group_expert", n), ("group_start", n), ("group_len", n))}
    runner.launch("moe_plan", ids=ids, n_pairs=n, k=k, E=E, max_groups=n, group_rows=MOE_GEMM_GROUP_ROWS, **plan)
    y_gu = _grouped(runner, "moe_gemm_q8_0", raw_gu, h, plan, gu_bias, 2 * ff, d)
    act = np.empty((n, ff), dtype=np.float32)
    kernel, source = ("gated_silu_f32", "elementwise") if activation == "silu" else ("gated_swiglu_oai_f32", "moe")
    kernel_runner(source).launch(kernel, out=act, gate_up=np.ascontiguousarray(y_gu), T=n, F=ff)
    y_down = _grouped(runner, "moe_gemm_q8_0", raw_down, act, plan, down_bias, d, ff, pair_rows=False)
    out = np.empty((T, d), dtype=np.float32)
    runner.launch("moe_combine_f32", out=out, y=np.ascontiguousarray(y_down), pair_of=plan["pair_of"],
                  weights=np.ascontiguousarray(weights, dtype=np.float32), T=T, k=k, d=d)
    moe = ExpertWeights(None, None, list(dense_gu.astype(np.float32)), list(dense_down.astype(np.float32)), gu_bias,
                        down_bias)
    want = numpy_moe.expert_ffn(NumpyBackend(), h, moe, ids, weights, activation)
    rel_err = np.linalg.norm(out - want) / np.linalg.norm(want)
    assert rel_err < 1e-2, f"relative error {rel_err:.2e}"
