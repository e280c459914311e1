"""Tiled prefill attention (engine/backends/cpu/prefill_attention.py) against the numpy backend's attention
(the reference: every key's score at once), and its exp against numpy's."""
import numpy as np
import pytest

from engine.backends.cpu import prefill_attention as cpu_prefill_attention
from engine.backends.cpu.backend import QuantizedNumpyBackend
from engine.backends.cpu.prefill_attention import fast_exp
from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.kv import KVLayout
from numba import njit

B, KVH, HD, H = 4, 2, 16, 6


def _pool(kv_type, rng, tables, lens, num_blocks=64):
    backend = NumpyBackend()
    pool = backend.create_kv_pool(KVLayout(num_blocks, B, 1, KVH, HD, kv_type))
    for table, n in zip(tables, lens):
        k, v = (rng.standard_normal((n, KVH, HD)).astype(np.float32) * 2 for _ in range(2))
        backend.store_kv(pool, 0, k, v, build_batch([(list(range(n)), 0, table)], B))
    return pool


@pytest.mark.parametrize("kv_type", ["f32", "f16", "int8"])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("query_rows", [1024, 10])
def test_tiles_of_few_keys_give_the_reference_attention(kv_type, window, query_rows, monkeypatch):
    monkeypatch.setattr(cpu_prefill_attention, "MIN_KEY_TILE", 5)  # many tiles, some across block borders
    monkeypatch.setattr(cpu_prefill_attention, "SCORE_BYTES", 1)
    monkeypatch.setattr(cpu_prefill_attention, "QUERY_ROWS", query_rows)  # 10: query blocks of 3 tokens
    rng = np.random.default_rng(4)
    tables = [np.array([9, 2, 3, 30, 31, 32, 4, 5, 6], np.int32), np.array([12, 13, 14, 15, 20, 21], np.int32)]
    pool = _pool(kv_type, rng, tables, [33, 23])
    # seq 0: a 13-token chunk at depth 20 (causal mask inside the chunk's tiles); seq 1: one decode token
    batch = build_batch([([1] * 13, 20, tables[0]), ([1], 22, tables[1])], B)
    q = rng.standard_normal((14, H, HD)).astype(np.float32)
    got = QuantizedNumpyBackend().attention(q, pool, 0, batch, 0.3, window)
    want = NumpyBackend().attention(q, pool, 0, batch, 0.3, window)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("query_rows", [1024, 13])
def test_sinks_join_every_rows_softmax_as_in_the_reference(query_rows, monkeypatch):
    monkeypatch.setattr(cpu_prefill_attention, "QUERY_ROWS", query_rows)
    rng = np.random.default_rng(5)
    table = np.arange(10, dtype=np.int32)
    pool = _pool("f32", rng, [table], [37])
    batch = build_batch([([1] * 17, 20, table)], B)
    q = rng.standard_normal((17, H, HD)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    got = QuantizedNumpyBackend().attention(q, pool, 0, batch, 0.25, 0, sinks=sinks)
    want = NumpyBackend().attention(q, pool, 0, batch, 0.25, 0, sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_one_tile_holds_a_bounded_number_of_scores():
    rows = cpu_prefill_attention.QUERY_ROWS  # a query block's rows
    assert 2 * rows * cpu_prefill_attention.key_tile(rows) * 4 <= max(
        cpu_prefill_attention.SCORE_BYTES, 2 * rows * cpu_prefill_attention.MIN_KEY_TILE * 4)


@njit
def _exps(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = fast_exp(x[i])
    return out


def test_fast_exp_is_within_a_few_ulp_of_numpy_down_to_underflow():
    x = np.concatenate([-np.logspace(-8, np.log10(80.0), 20000), [0.0]]).astype(np.float32)
    want = np.exp(x.astype(np.float64))
    np.testing.assert_allclose(_exps(x), want, rtol=4e-7)
    assert _exps(np.array([-np.inf, -200.0], np.float32)).max() < 1e-37
