"""The elementwise, norm, rope and KV-pool kernels against the numpy backend (the reference semantics), run
on the CPU (tests/support/kernel_emulator.py) and, where there is one, on a GPU (tests/support/kernel_gpu.py).
Odd sizes, so no thread count divides a problem evenly."""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.kv import KVLayout

REF = NumpyBackend()
TOL = dict(rtol=2e-6, atol=2e-6)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("scale", [1.0, 5.5])
def test_embedding_matches_numpy(kernel_runner, scale):
    table, ids = rand(50, 37), np.array([3, 0, 49, 3, 17], dtype=np.int32)
    out = np.zeros((5, 37), np.float32)
    kernel_runner("elementwise").launch("embedding_f32", out=out, table=table, ids=ids, T=5, d=37, scale=scale)
    np.testing.assert_array_equal(out, REF.embedding(table, ids, scale))


def test_add_split_and_gather_match_numpy(kernel_runner):
    lib = kernel_runner("elementwise")
    a, b = rand(1001), rand(1001, seed=1)
    out = np.zeros(1001, np.float32)
    lib.launch("add_f32", out=out, a=a, b=b, n=1001)
    np.testing.assert_array_equal(out, a + b)
    lib.launch("mul_f32", out=out, a=a, b=b, n=1001)
    np.testing.assert_array_equal(out, a * b)  # lfm2's gates (engine/short_conv.py multiplies in numpy)
    x = rand(7, 99)
    part = np.zeros((7, 33), np.float32)
    lib.launch("split_columns_f32", out=part, x=x, T=7, in_cols=99, col_start=40, out_cols=33)
    np.testing.assert_array_equal(part, REF.split_heads(x, (40, 33, 26), 1)[1].reshape(7, 33))
    rows = np.array([6, 0, 6], dtype=np.int64)
    gathered = np.zeros((3, 99), np.float32)
    lib.launch("gather_rows_f32", out=gathered, x=x, rows=rows, n_rows=3, d=99)
    np.testing.assert_array_equal(gathered, x[rows])


@pytest.mark.parametrize("kernel, kind", [("gated_silu_f32", "silu"), ("gated_gelu_tanh_f32", "gelu_tanh")])
def test_gated_activations_match_numpy(kernel_runner, kernel, kind):
    gate_up = rand(5, 2 * 131) * 4
    out = np.zeros((5, 131), np.float32)
    kernel_runner("elementwise").launch(kernel, out=out, gate_up=gate_up, T=5, F=131)
    np.testing.assert_allclose(out, REF.gated_activation(gate_up, kind), **TOL)


@pytest.mark.parametrize("n", [1, 31, 577, 4099])
def test_rms_norm_matches_numpy(kernel_runner, n):
    x, w = rand(3, n) * 3, rand(n, seed=2)
    out = np.zeros_like(x)
    kernel_runner("norms").launch("rms_norm_f32", out=out, x=x, w=w, rows=3, n=n, eps=1e-6)
    np.testing.assert_allclose(out, REF.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_add_rms_norm_in_place_matches_numpy(kernel_runner):
    x, delta, w = rand(4, 577), rand(4, 577, seed=1), rand(577, seed=2)
    want_sum, want_norm = REF.add_rms_norm(x, delta, w, 1e-5)
    norm = np.zeros_like(x)
    kernel_runner("norms").launch(
        "add_rms_norm_f32", sum_out=x, norm_out=norm, x=x, delta=delta, w=w, rows=4, n=577, eps=1e-5
    )  # sum_out is x itself: the residual stream updated in place
    np.testing.assert_array_equal(x, want_sum)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-5, atol=1e-6)


def rope_tables(max_pos, rope_dims, base=10000.0):
    inv_freq = base ** (-np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)
    angles = np.outer(np.arange(max_pos), inv_freq)  # [max_pos, rope_dims / 2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("rope_dims", [80, 46])  # full and partial rotary
def test_rope_neox_matches_numpy(kernel_runner, rope_dims):
    x, positions = rand(5, 3, 80), np.array([0, 1, 7, 30, 2], dtype=np.int32)
    cos, sin = rope_tables(32, rope_dims)
    want = REF.rope(x, positions, (cos, sin), rope_dims)
    kernel_runner("rope").launch("rope_neox_f32", x=x, positions=positions, cos=cos, sin=sin, T=5, H=3, hd=80,
                                    rope_dims=rope_dims)
    np.testing.assert_allclose(x, want, **TOL)


def test_rope_norm_rotates_adjacent_pairs(kernel_runner):
    x, positions = rand(4, 2, 12), np.array([3, 0, 9, 1], dtype=np.int32)
    cos, sin = rope_tables(10, 8)
    # The adjacent-pair layout is the NeoX layout after de-interleaving the first rope_dims columns.
    order = np.concatenate((np.arange(0, 8, 2), np.arange(1, 8, 2), np.arange(8, 12)))
    want = np.empty_like(x)
    want[..., order] = REF.rope(x[..., order], positions, (cos, sin), 8)
    kernel_runner("rope").launch("rope_norm_f32", x=x, positions=positions, cos=cos, sin=sin, T=4, H=2, hd=12,
                                    rope_dims=8)
    np.testing.assert_allclose(x, want, **TOL)


def test_store_kv_writes_slots_and_skips_negative_ones(kernel_runner):
    layout = KVLayout(num_blocks=5, block_size=3, n_layers=1, n_kv_heads=2, head_dim=7)
    pool = REF.create_kv_pool(layout)
    k, v = rand(4, 2, 7), rand(4, 2, 7, seed=1)
    batch = build_batch([([1, 2, 3], 2, np.array([4, 1])), ([5], 0, np.array([0]))], block_size=3)
    REF.store_kv(pool, 0, k, v, batch)
    slots = np.append(batch.slot_mapping[:3], -1).astype(np.int64)  # the last row is padding
    pool_k, pool_v = np.zeros((2, 15, 7), np.float32), np.zeros((2, 15, 7), np.float32)
    kernel_runner("kv_blocks").launch("store_kv_f32", pool_layer_k=pool_k, pool_layer_v=pool_v, k=k, v=v,
                                         slots=slots, T=4, KVH=2, hd=7, num_slots=15, seg_rows=0)
    pool.k[0][:, batch.slot_mapping[3]] = 0  # the reference stored the row the kernel skipped
    pool.v[0][:, batch.slot_mapping[3]] = 0
    np.testing.assert_array_equal(pool_k, pool.k[0])
    np.testing.assert_array_equal(pool_v, pool.v[0])


def device_pool(pool) -> np.ndarray:
    """The numpy pool in the CUDA layout [layers, 2 (K, V), KVH, num_slots, hd]."""
    return np.ascontiguousarray(np.stack((pool.k, pool.v), axis=1))


@pytest.mark.parametrize("block_size, hd", [(4, 8), (3, 3)])  # float4 copies, and single floats
def test_kv_block_moves_match_numpy(kernel_runner, block_size, hd):
    layout = KVLayout(num_blocks=6, block_size=block_size, n_layers=2, n_kv_heads=3, head_dim=hd)
    pool = REF.create_kv_pool(layout)
    pool.k[...], pool.v[...] = rand(*pool.k.shape), rand(*pool.v.shape, seed=1)
    planes, block_elems = 2 * 2 * 3, block_size * hd
    sizes = dict(planes=planes, num_slots=layout.num_slots, block_elems=block_elems, hd=hd)
    lib = kernel_runner("kv_blocks")

    staging = np.zeros((2, planes, block_elems), np.float32)
    blocks = np.array([4, 1], dtype=np.int32)
    lib.launch("gather_kv_blocks_f32", staging=staging, pool=device_pool(pool), blocks=blocks, n=2, **sizes)
    for i, block in enumerate(blocks):
        k, v = REF.read_block(pool, int(block))  # [layers, KVH, block_size, hd]
        want = np.stack((k, v), axis=1).reshape(planes, block_elems)
        np.testing.assert_array_equal(staging[i], want)

    restored = np.zeros_like(device_pool(pool))
    lib.launch("scatter_kv_blocks_f32", staging=staging, pool=restored, blocks=np.array([0, 5], np.int32), n=2, **sizes)
    after = REF.create_kv_pool(layout)
    REF.restore_blocks(pool, after, [(4, 0), (1, 5)])
    np.testing.assert_array_equal(restored, device_pool(after))

    copied = device_pool(pool)
    lib.launch("copy_kv_blocks_f32", pool=copied, src_blocks=np.array([2, 3], np.int32),
               dst_blocks=np.array([5, 0], np.int32), n_pairs=2, **sizes)
    REF.copy_blocks(pool, [(2, 5), (3, 0)])
    np.testing.assert_array_equal(copied, device_pool(pool))
