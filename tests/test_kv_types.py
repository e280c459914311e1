"""--kv-type on numpy: the row codecs, attention over compact rows, block moves that carry int8 scales,
and the bytes per token every pool and tier sizes from."""
from types import SimpleNamespace

import numpy as np
import pytest

from engine.backends.capabilities import Capabilities
from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.kv import KVLayout, layout_for, resolve_kv_type
from engine.kv_quant import decode_rows, encode_rows, split_rows
from engine.sequence import ModelRunner, Sequence
from scheduler.engine_loop import EngineLoop

B, KVH, HD = 4, 2, 8
COMPACT = ("f16", "int8")


def _layout(kv_type, num_blocks=12, n_layers=2):
    return KVLayout(num_blocks, B, n_layers, KVH, HD, kv_type)


def test_bytes_per_token_follow_the_type_and_size_every_pool():
    assert {t: _layout(t).bytes_per_token for t in ("f32", "f16", "int8")} == {
        "f32": 2 * 2 * KVH * HD * 4, "f16": 2 * 2 * KVH * HD * 2, "int8": 2 * 2 * KVH * (HD + 4)}
    backend = NumpyBackend()
    for kv_type in ("f32", "f16", "int8"):
        layout = _layout(kv_type)
        assert layout.bytes_per_block == layout.bytes_per_token * B
        assert backend.create_kv_pool(layout).nbytes == layout.total_bytes
        host = backend.create_host_pool(layout)
        assert host.nbytes == layout.total_bytes
        backend.grow_host_pool(host, 20)
        assert host.nbytes == 20 * layout.bytes_per_block


def test_int8_rows_decode_within_half_a_step_and_keep_zero_rows_zero():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, HD)).astype(np.float32) * np.float32(7)
    x[1, 2] = 0
    rows = encode_rows(x, "int8")
    assert rows.dtype == np.int8 and rows.shape == (5, 3, HD + 4)
    values, scale = split_rows(rows, HD)
    np.testing.assert_array_equal(scale, np.abs(x).max(axis=-1) / np.float32(127))
    assert np.abs(values).max(axis=-1).tolist() == [[127] * 3, [127, 127, 0], *[[127] * 3] * 3]
    err = np.abs(decode_rows(rows, HD) - x)
    assert (err <= scale[..., None] * 0.5 * (1 + 1e-5)).all()
    assert not decode_rows(rows, HD)[1, 2].any()


def test_a_tokens_stored_rows_do_not_depend_on_how_the_writes_were_chunked():
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((11, KVH, HD)).astype(np.float32) for _ in range(2))
    table = np.array([3, 7, 1], dtype=np.int32)
    backend, one, chunked = NumpyBackend(), *(NumpyBackend().create_kv_pool(_layout("int8")) for _ in range(2))
    backend.store_kv(one, 0, k, v, build_batch([(list(range(11)), 0, table)], B))
    for start, stop in ((0, 3), (3, 4), (4, 11)):
        batch = build_batch([(list(range(start, stop)), start, table)], B)
        backend.store_kv(chunked, 0, k[start:stop], v[start:stop], batch)
    np.testing.assert_array_equal(one.k, chunked.k)
    np.testing.assert_array_equal(one.v, chunked.v)


def _filled_pools(kv_type, rng, tables, lens):
    """A pool of kv_type holding random K/V for each sequence, and an f32 pool of its decoded rows."""
    backend, layout = NumpyBackend(), _layout(kv_type, num_blocks=40, n_layers=1)
    pool = backend.create_kv_pool(layout)
    for table, n in zip(tables, lens):
        k, v = (rng.standard_normal((n, KVH, HD)).astype(np.float32) * 3 for _ in range(2))
        backend.store_kv(pool, 0, k, v, build_batch([(list(range(n)), 0, table)], B))
    reference = backend.create_kv_pool(_layout("f32", num_blocks=40, n_layers=1))
    reference.k[...], reference.v[...] = decode_rows(pool.k, HD), decode_rows(pool.v, HD)
    return pool, reference


@pytest.mark.parametrize("kv_type", COMPACT)
@pytest.mark.parametrize("window", [0, 6])
def test_attention_over_compact_rows_equals_f32_attention_over_their_decoded_values(kv_type, window):
    rng = np.random.default_rng(2)
    tables = [np.array([9, 2, 3, 30, 31, 4], np.int32), np.array([12, 13, 14, 15, 20], np.int32)]
    lens = [22, 17]
    pool, reference = _filled_pools(kv_type, rng, tables, lens)
    # seq 0 decodes its 22nd token, seq 1 recomputes its last 5 (a prefill chunk): both read every run
    batch = build_batch([([1], 21, tables[0]), ([1] * 5, 12, tables[1])], B)
    q = rng.standard_normal((6, 2 * KVH, HD)).astype(np.float32)
    backend = NumpyBackend()
    got = backend.attention(q, pool, 0, batch, 0.35, window)
    want = backend.attention(q, reference, 0, batch, 0.35, window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # float32 round-off of values ~5


@pytest.mark.parametrize("kv_type", ("f32",) + COMPACT)
def test_copies_parks_restores_and_reads_carry_the_rows_and_their_scales(kv_type):
    rng = np.random.default_rng(3)
    backend = NumpyBackend()
    pool, _ = _filled_pools(kv_type, rng, [np.arange(8, dtype=np.int32)], [32])
    original = [a.copy() for a in backend.read_block(pool, 5)]
    host = backend.create_host_pool(_layout(kv_type, num_blocks=2, n_layers=1))
    backend.park_blocks(pool, host, [(5, 1)])
    backend.write_block(pool, 5, np.zeros_like(original[0]), np.zeros_like(original[1]))
    backend.restore_blocks(host, pool, [(1, 5)])
    backend.copy_blocks(pool, [(5, 30)])
    for block in (5, 30):
        for got, want in zip(backend.read_block(pool, block), original):
            np.testing.assert_array_equal(got, want)
    if kv_type == "int8":
        assert split_rows(original[0], HD)[1].min() > 0  # the scales were there to carry


def test_a_layer_split_runner_moves_whole_int8_blocks_across_its_stages(load_tiny):
    model, _ = load_tiny("llama", seed=4)
    runner = ModelRunner(model, 16, B, host_blocks=2, layer_split=(1,), kv_type="int8")
    seq = Sequence(list(range(3, 14)))
    assert runner.ensure_blocks(seq, len(seq.token_ids))
    runner.step([(seq, len(seq.token_ids))])
    k, v = runner.read_block("device", seq.block_table[1])
    assert k.dtype == np.int8 and k.shape[0] == model.config.n_layers and k.shape[-1] == model.config.head_dim + 4
    runner.apply_moves([(seq.block_table[1], 0)], [], [], [])
    runner.write_block(15, k, v)
    for got, want in zip(runner.read_block("host", 0), (k, v)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(runner.read_block("device", 15), (k, v)):
        np.testing.assert_array_equal(got, want)


def test_kv_type_auto_is_the_backends_first_and_an_unsupported_type_names_the_supported_ones():
    assert resolve_kv_type("auto", NumpyBackend()) == "f16"
    assert resolve_kv_type("int8", NumpyBackend()) == "int8"

    class F16Only:
        name, capabilities = "fake", Capabilities(kv_types=("f16",))

    assert resolve_kv_type("auto", F16Only()) == "f16"
    with pytest.raises(ValueError, match="--kv-type int8 is not supported by the fake backend .it runs: f16."):
        resolve_kv_type("int8", F16Only())
    with pytest.raises(ValueError, match="--kv-type 'q4'"):
        layout_for(SimpleNamespace(n_layers=1, n_kv_layers=1, n_kv_heads=1, head_dim=4), 1, B, "q4")


def test_the_cache_snapshot_shows_the_type_and_its_bytes_per_token(load_tiny):
    model, tokenizer = load_tiny("llama", seed=4)
    runner = ModelRunner(model, 16, B, kv_type="int8")
    kv = EngineLoop(runner, tokenizer, num_slots=1, prefill_chunk=8, max_queue=1).cache_snapshot()["kv"]
    cfg = model.config
    assert kv == {"type": "int8", "bytes_per_token": 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + 4),
                  "bytes_per_block": 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + 4) * B}


def test_serve_sizes_the_pool_from_the_types_bytes_and_logs_them(tmp_path, caplog):

    from api.config import ServerConfig
    from api.serve import build_state
    from engine.loader import open_model
    from tests.support.tiny_gguf import write_tiny_gguf

    write_tiny_gguf(tmp_path / "m.gguf", "llama", seed=4)
    loaded = open_model(str(tmp_path / "m.gguf"), backend=NumpyBackend())
    blocks = {}
    for kv_type in ("f32", "int8"):
        config = ServerConfig(port=0).replace(kv_type=kv_type, kv_cache_mib=1, ctx_size=64, batch=1,
                         conversation_cache_mib=0)
        with caplog.at_level("INFO", logger="strata.serve"):
            runner = build_state(config, loaded).engine.runner
        per_token = runner.layout.bytes_per_token
        assert f"K/V {kv_type}, {per_token} bytes per token" in caplog.text
        blocks[kv_type] = runner.layout.num_blocks
        assert blocks[kv_type] == 2**20 // (per_token * 16)
    assert blocks["int8"] > 3 * blocks["f32"]
