"""The CUDA backend against the numpy reference: every op, the KV pool, whole models, graphs.

Each test runs three times: on a real GPU (marked `cuda`, skipped without one); on tests/support/fake_cuda.py, a CPU
stand-in for the driver with numpy twins of the kernels that checks the backend's own code (argument packing
against the contract, pointer offsets, staging, graph capture); and on tests/support/fake_cuda_emulated.py, the same
driver running the real kernel sources under g++ (with red zones and alignment checks), so the backend and
the kernels are checked against each other without a GPU. Outputs are poisoned with NaN before
each op, so an element a kernel fails to write shows up.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.kv import KVLayout
from engine.model import load_model
from engine.quant_weights import LinearPart
from engine.sequence import ModelRunner, Sequence
from tests.support.cuda_backend_checks import (
    BLOCK, EXACT, GEMM, REDUCE, assert_close, greedy_tokens, host_copy, kv_case, launch_log, randn,
)
from tests.support.reference_helpers import chunked_step_logits
from tests.support.tiny_gguf import write_tiny_gguf


def test_embedding_rms_norm_add_and_activations_match_numpy(cuda):
    rng, ref = np.random.default_rng(0), NumpyBackend()
    table, ids = randn(rng, 50, 24), np.array([3, 0, 49, 3, 7], dtype=np.int64)
    assert_close(host_copy(cuda, cuda.embedding(cuda.upload(table), ids, 2.5)), ref.embedding(table, ids, 2.5), EXACT)
    x, delta, w = randn(rng, 5, 24), randn(rng, 5, 24), randn(rng, 24)
    dx, dd, dw = cuda.upload_activation(x), cuda.upload_activation(delta), cuda.upload(w)
    assert_close(host_copy(cuda, cuda.rms_norm(dx, dw, 1e-6)), ref.rms_norm(x, w, 1e-6), REDUCE)
    total, normed = cuda.add_rms_norm(dx, dd, dw, 1e-5)
    ref_total, ref_normed = ref.add_rms_norm(x, delta, w, 1e-5)
    assert_close(host_copy(cuda, total), ref_total, EXACT)
    assert_close(host_copy(cuda, normed), ref_normed, REDUCE)
    assert_close(host_copy(cuda, dx + dd), x + delta, EXACT)
    heads = randn(rng, 5, 3, 8)  # QK-norm: rows = T * H
    assert_close(host_copy(cuda, cuda.rms_norm(cuda.upload_activation(heads), cuda.upload(w[:8]), 1e-6)),
                 ref.rms_norm(heads, w[:8], 1e-6), REDUCE)
    gate_up = randn(rng, 5, 32)
    for kind in ("silu", "gelu_tanh"):
        assert_close(host_copy(cuda, cuda.gated_activation(cuda.upload_activation(gate_up), kind)),
                     ref.gated_activation(gate_up, kind), REDUCE)


def test_split_heads_rope_and_gather_rows_match_numpy(cuda):
    rng, ref = np.random.default_rng(1), NumpyBackend()
    qkv = randn(rng, 6, 64 + 32 + 32)
    parts = cuda.split_heads(cuda.upload_activation(qkv), (64, 32, 32), 16)
    for got, want in zip(parts, ref.split_heads(qkv, (64, 32, 32), 16)):
        assert got.shape == want.shape
        assert_close(host_copy(cuda, got), want, EXACT)
    positions = np.array([0, 1, 2, 9, 10, 30], dtype=np.int64)
    for rope_dims in (16, 8):  # full and partial rotary
        cos, sin = (np.cos(np.outer(np.arange(40), np.arange(rope_dims // 2) * 0.3)).astype(np.float32),
                    np.sin(np.outer(np.arange(40), np.arange(rope_dims // 2) * 0.3)).astype(np.float32))
        q = randn(rng, 6, 4, 16)
        got = cuda.rope(cuda.upload_activation(q), positions, (cuda.upload(cos), cuda.upload(sin)), rope_dims)
        assert_close(host_copy(cuda, got), ref.rope(q, positions, (cos, sin), rope_dims), REDUCE)
    x = randn(rng, 6, 8)
    rows = np.array([5, 0, 2], dtype=np.int64)
    assert_close(host_copy(cuda, cuda.gather_rows(cuda.upload_activation(x), rows)), x[rows], EXACT)


@pytest.mark.parametrize("rows", [1, 4, 40])  # matvec, matvec, gemm
def test_linear_f32_with_bias_matches_numpy(cuda, rows):
    rng = np.random.default_rng(2)
    x, w, b = randn(rng, rows, 64), randn(rng, 48, 64), randn(rng, 48)
    got = cuda.linear(cuda.upload_activation(x), cuda.upload_linear(w), cuda.upload(b))
    assert_close(host_copy(cuda, got), NumpyBackend().linear(x, w, b), REDUCE if rows <= 8 else GEMM)


@pytest.mark.parametrize("rows", [2, 33])
def test_linear_of_mixed_type_parts_writes_each_column_range(cuda, rows):
    rng = np.random.default_rng(3)
    weights = [(Q.Q4_0, randn(rng, 64, 64)), (Q.Q8_0, randn(rng, 32, 64)), (Q.F16, randn(rng, 32, 64))]
    parts, dense = [], []
    for tensor_type, w in weights:
        if tensor_type == Q.F16:
            raw, back = w.astype(np.float16).view(np.uint8), w.astype(np.float16).astype(np.float32)
        else:
            raw = quantize(w, tensor_type)
            from gguf.quants import dequantize

            back = dequantize(raw, tensor_type).astype(np.float32)
        parts.append(LinearPart(tensor_type, raw, w.shape[0], 64, tensor_type.name))
        dense.append(back)
    x, bias = randn(rng, rows, 64), randn(rng, 128)
    got = cuda.linear(cuda.upload_activation(x), cuda.upload_linear_quantized(parts), cuda.upload(bias))
    expected = x @ np.concatenate(dense).T + bias
    assert_close(host_copy(cuda, got), expected, REDUCE if rows <= 8 else GEMM)
    kind, log = "matvec" if rows <= 8 else "gemm", launch_log(cuda)
    assert log is None or [k for k in log if k.startswith(kind)] == [f"{kind}_q4_0", f"{kind}_q8_0", f"{kind}_f16"]


@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_over_scattered_blocks_with_gqa_matches_numpy(cuda, window):
    layout = KVLayout(num_blocks=12, block_size=BLOCK, n_layers=2, n_kv_heads=2, head_dim=8)
    seqs = [(37, 5, np.array([7, 2, 9])), (16, 1, np.array([0])), (20, 20, np.array([11, 4]))]
    got, want, _ = kv_case(cuda, layout, seqs, window, np.random.default_rng(4))
    assert_close(got, want, REDUCE)


def test_long_context_decode_uses_split_attention_and_matches_numpy(cuda):
    layout = KVLayout(num_blocks=120, block_size=BLOCK, n_layers=2, n_kv_heads=2, head_dim=8)
    blocks = np.random.default_rng(5).permutation(120)  # 1280 keys: several 512-key chunks
    # Disjoint tables: two rows of one store_kv writing the same slot race on a GPU (no order between blocks).
    got, want, _ = kv_case(cuda, layout, [(1270, 1, blocks[:80]), (600, 2, blocks[80:])], 0, np.random.default_rng(6))
    assert_close(got, want, REDUCE)
    log = launch_log(cuda)
    assert log is None or "paged_attention_split_f32" in log


def test_kv_block_copy_park_restore_read_write_round_trip(cuda):
    layout = KVLayout(num_blocks=8, block_size=BLOCK, n_layers=2, n_kv_heads=2, head_dim=8)
    rng = np.random.default_rng(7)
    pool, host = cuda.create_kv_pool(layout), cuda.create_host_pool(KVLayout(3, BLOCK, 2, 2, 8))
    cuda.grow_host_pool(host, 6)  # a second pinned segment: slots 3..5
    blocks = {b: (randn(rng, 2, 2, BLOCK, 8), randn(rng, 2, 2, BLOCK, 8)) for b in range(8)}

    def expect(tier_pool, pairs):  # (block read back, block whose data it must hold), K and V
        for block, source in pairs:
            for got, want in zip(cuda.read_block(tier_pool, block), blocks[source]):
                np.testing.assert_array_equal(got, want)

    for b, (k, v) in blocks.items():
        cuda.write_block(pool, b, k, v)
    expect(pool, [(b, b) for b in blocks])
    cuda.copy_blocks(pool, [(1, 6), (2, 7)])
    expect(pool, [(6, 1), (7, 2)])
    cuda.park_blocks(pool, host, [(3, 4), (4, 5), (0, 0), (5, 2), (6, 3)])  # slots 4, 5: one run; 2, 3: two
    expect(host, [(4, 3), (5, 4), (0, 0), (2, 5), (3, 1)])  # device block 6 holds a copy of 1
    cuda.restore_blocks(host, pool, [(4, 1), (5, 0), (0, 7)])
    expect(pool, [(1, 3), (0, 4), (7, 0), (2, 2), (6, 1)])  # the last two untouched
    launched = launch_log(cuda)
    if launched is not None:
        assert {"copy_kv_blocks_f32", "gather_kv_blocks_f32", "scatter_kv_blocks_f32"} <= set(launched)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_greedy_tokens_of_a_tiny_model_equal_numpy(cuda, tmp_path, arch):
    write_tiny_gguf(tmp_path / "m.gguf", arch, quant="Q8_0")
    cuda.graphs = None
    expected = greedy_tokens(load_model(tmp_path / "m.gguf", NumpyBackend())[0], range(3, 40))
    assert greedy_tokens(load_model(tmp_path / "m.gguf", cuda)[0], range(3, 40)) == expected


def test_steps_run_on_another_thread_than_the_load(cuda, tmp_path):
    """The server loads on the main thread and steps on its compute thread (scheduler/engine_loop.py)."""
    from concurrent.futures import ThreadPoolExecutor

    write_tiny_gguf(tmp_path / "m.gguf", "llama", quant="Q8_0")
    model = load_model(tmp_path / "m.gguf", cuda)[0]
    with ThreadPoolExecutor(1) as pool:
        tokens = pool.submit(greedy_tokens, model, range(3, 20), 4).result()
    assert tokens == greedy_tokens(load_model(tmp_path / "m.gguf", NumpyBackend())[0], range(3, 20), 4)


def test_graph_replay_equals_eager(cuda, tmp_path):
    from engine.backends.cuda.graphs import DecodeGraphs

    write_tiny_gguf(tmp_path / "m.gguf", "qwen3", quant="Q8_0")
    model = load_model(tmp_path / "m.gguf", cuda)[0]
    runner = ModelRunner(model, num_blocks=16, block_size=BLOCK)
    seqs = [Sequence(list(range(5, 5 + n))) for n in (20, 33, 7)]
    for seq in seqs:
        runner.ensure_blocks(seq, len(seq.token_ids) + 4)
        runner.step([(seq, len(seq.token_ids) - 1)])
    eager = model.forward(_decode_batch(seqs), runner.kv_pool)
    cuda.graphs = DecodeGraphs(cuda)
    first = runner.step([(seq, 1) for seq in seqs])  # captures, then replays
    for seq in seqs:
        seq.num_computed -= 1
    again = runner.step([(seq, 1) for seq in seqs])  # replays the same graph with fresh inputs
    assert cuda.graphs.captures == 1 and cuda.graphs.replays == 2
    assert_close(first, eager, REDUCE)
    assert_close(again, first, EXACT)


def _decode_batch(seqs):
    return build_batch([(s.token_ids[-1:], len(s.token_ids) - 1, np.asarray(s.block_table)) for s in seqs], BLOCK)


def test_a_layer_split_runs_each_stage_on_its_own_handle_and_matches_numpy(cuda, tmp_path):
    """Stages get their own backend (stream, workspace) through for_stage, hand (x, h) over as host copies,
    and block moves use a sibling handle; logits and every moved block equal the one-stage numpy run."""
    write_tiny_gguf(tmp_path / "m.gguf", "qwen3", quant="Q8_0")
    cuda.graphs = None
    model = load_model(tmp_path / "m.gguf", cuda)[0]
    reference = load_model(tmp_path / "m.gguf", NumpyBackend())[0]
    split = ModelRunner(model, num_blocks=16, block_size=4, host_blocks=4, layer_split=(1, 2))
    whole = ModelRunner(reference, num_blocks=16, block_size=4, host_blocks=4)
    backends = [s.backend for s in split.stages]
    assert backends[0] is cuda and len({id(b) for b in backends}) == 3
    assert all(s.mover is not s.backend for s in split.stages)
    prompts = [list(range(3, 16)), list(range(40, 47))]  # batched chunks: a 13-row gemm step, then decode
    logits = [chunked_step_logits(runner, prompts) for runner in (split, whole)]
    for runner in (split, whole):
        runner.move_blocks([(1, 2)], [(2, 9)], [(0, 10)])  # park block 1, restore it as 9, copy 0 to 10
    # A prefill chunk runs the fp16 tensor-core gemm on real kernels: its tolerance for everything after.
    for got, want in zip(*logits):
        assert_close(got, want, GEMM)
    for tier, block in (("host", 2), ("device", 9), ("device", 10)):
        for got, want in zip(split.read_block(tier, block), whole.read_block(tier, block)):
            assert_close(got, want, GEMM)
    blocks = [split.read_block(tier, block)[0] for tier, block in (("device", 1), ("host", 2), ("device", 9))]
    np.testing.assert_array_equal(blocks[0], blocks[1])  # a move copies bits, whatever computed them
    np.testing.assert_array_equal(blocks[1], blocks[2])
