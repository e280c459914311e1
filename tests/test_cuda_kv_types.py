"""--kv-type f16 and int8 on the CUDA backend against the numpy backend of the same type: the stored bytes
(store_kv_f16 / store_kv_int8 must write exactly engine/kv_quant.py's rows, scales included), paged and
split-K attention over those rows, block moves that carry the scales, and whole tiny models.

Each runs on a GPU (marked `cuda`), on the numpy twins of the kernels (tests/support/fake_cuda.py) and on the real
kernel sources under g++ (tests/support/fake_cuda_emulated.py), through the `cuda` fixture of tests/conftest.py.
"""
import numpy as np
import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.kv import KVLayout
from engine.model import load_model
from tests.support.cuda_backend_checks import BLOCK, REDUCE, assert_close, greedy_tokens, kv_case, launch_log, randn
from tests.support.tiny_gguf import write_tiny_gguf

COMPACT = ("f16", "int8")


@pytest.mark.parametrize("kv_type", COMPACT)
@pytest.mark.parametrize("head_dim", [8, 80])
def test_store_kv_writes_the_numpy_rows_and_attention_over_them_matches_numpy(cuda, kv_type, head_dim):
    layout = KVLayout(num_blocks=12, block_size=BLOCK, n_layers=2, n_kv_heads=2, head_dim=head_dim, kv_type=kv_type)
    seqs = [(37, 5, np.array([7, 2, 9])), (16, 1, np.array([0])), (20, 20, np.array([11, 4]))]
    got, want, (pool, ref_pool) = kv_case(cuda, layout, seqs, 5, np.random.default_rng(4))
    assert_close(got, want, REDUCE)
    ref = NumpyBackend()
    for block in (7, 2, 9, 0, 11, 4):
        for got_rows, want_rows in zip(cuda.read_block(pool, block), ref.read_block(ref_pool, block)):
            assert got_rows.dtype == want_rows.dtype and got_rows.shape == want_rows.shape
            np.testing.assert_array_equal(got_rows[1], want_rows[1])  # layer 1: the one kv_case stored
    log = launch_log(cuda)
    assert log is None or {f"store_kv_{kv_type}", f"paged_attention_{kv_type}"} <= set(log)


@pytest.mark.parametrize("kv_type", COMPACT)
def test_long_context_decode_over_compact_rows_uses_split_attention(cuda, kv_type):
    layout = KVLayout(num_blocks=120, block_size=BLOCK, n_layers=2, n_kv_heads=2, head_dim=8, kv_type=kv_type)
    blocks = np.random.default_rng(5).permutation(120)
    got, want, _ = kv_case(cuda, layout, [(1270, 1, blocks[:80]), (600, 2, blocks[80:])], 0,
                           np.random.default_rng(6))
    assert_close(got, want, REDUCE)
    log = launch_log(cuda)
    assert log is None or {f"paged_attention_split_{kv_type}", "attention_combine_f32"} <= set(log)


@pytest.mark.parametrize("kv_type", COMPACT)
def test_block_moves_carry_compact_rows_and_their_scales(cuda, kv_type):
    layout = KVLayout(num_blocks=8, block_size=BLOCK, n_layers=2, n_kv_heads=2, head_dim=8, kv_type=kv_type)
    ref, rng = NumpyBackend(), np.random.default_rng(7)
    source = ref.create_kv_pool(layout)  # rows as numpy stores them: the bytes every move must keep
    batch = build_batch([(list(range(8 * BLOCK)), 0, np.arange(8))], BLOCK)
    for layer in range(2):
        ref.store_kv(source, layer, *(randn(rng, 8 * BLOCK, 2, 8) * 3 for _ in range(2)), batch)
    blocks = {b: ref.read_block(source, b) for b in range(8)}
    pool, host = cuda.create_kv_pool(layout), cuda.create_host_pool(KVLayout(3, BLOCK, 2, 2, 8, kv_type))
    cuda.grow_host_pool(host, 6)
    for b, (k, v) in blocks.items():
        cuda.write_block(pool, b, k, v)
    cuda.copy_blocks(pool, [(1, 6)])
    cuda.park_blocks(pool, host, [(3, 4), (4, 5), (6, 2)])
    cuda.restore_blocks(host, pool, [(4, 0), (5, 7), (2, 1)])
    for tier, block, want in ((pool, 0, 3), (pool, 7, 4), (pool, 1, 1), (host, 2, 1), (pool, 6, 1)):
        for got_rows, want_rows in zip(cuda.read_block(tier, block), blocks[want]):
            np.testing.assert_array_equal(got_rows, want_rows)


@pytest.mark.parametrize("kv_type", COMPACT)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_tokens_of_a_tiny_model_with_compact_kv_equal_numpy(cuda, tmp_path, arch, kv_type):
    """An 8-token prefill (the fp32 matvec, not the fp16 gemm): K/V reach store_kv equal to float32 rounding,
    so the stored rows agree; a random tiny model's near-tied logits would flip on one int8 step otherwise."""
    write_tiny_gguf(tmp_path / "m.gguf", arch, quant="Q8_0")
    cuda.graphs = None
    expected = greedy_tokens(load_model(tmp_path / "m.gguf", NumpyBackend())[0], range(3, 11), kv_type=kv_type)
    assert greedy_tokens(load_model(tmp_path / "m.gguf", cuda)[0], range(3, 11), kv_type=kv_type) == expected


def test_the_cuda_backend_defaults_to_f16_kv():
    from engine.backends.cuda.backend import CudaBackend
    from engine.kv import resolve_kv_type

    assert CudaBackend.capabilities.kv_types[0] == "f16"
    assert resolve_kv_type("auto", CudaBackend.__new__(CudaBackend)) == "f16"
