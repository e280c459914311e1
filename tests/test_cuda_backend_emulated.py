"""The CUDA backend on the REAL kernel sources, run on the CPU (tests/fake_cuda_emulated.py): every op against
the numpy backend, then whole tiny models token for token. Where tests/test_cuda_backend.py checks the backend
against numpy twins of the kernels written from the doc, these check it against the kernels themselves, so a
mismatch in argument order, int vs pointer, index dtypes, buffer sizes or offsets fails here without a GPU.

The emulator runs one OS thread per CUDA thread, block after block: shapes are kept small.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from engine.backends.numpy_backend import NumpyBackend
from engine.kv import KVLayout
from engine.model import load_model
from engine.quant_weights import LinearPart
from engine.sequence import ModelRunner, Sequence
from tests.test_cuda_backend import BLOCK, EXACT, GEMM, REDUCE, _close, _host, _kv_case, _rand
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="session")
def emulator_dir(tmp_path_factory):
    from tests.kernel_emulator import compiler_available

    if not compiler_available():
        pytest.skip("g++ is needed to run the CUDA kernels on the CPU")
    return tmp_path_factory.mktemp("emulated_backend_kernels")


@pytest.fixture
def emu(emulator_dir, monkeypatch):
    """A CudaBackend whose launches run the real kernels (graphs off; outputs poisoned with NaN)."""
    from tests import fake_cuda_emulated

    driver = fake_cuda_emulated.install(monkeypatch, emulator_dir)
    from engine.backends.cuda_backend import CudaBackend

    backend = CudaBackend(graphs=False)
    backend.poison = True
    backend.emulator = driver
    yield backend
    backend.close()


def test_embedding_rms_norm_add_and_activations_match_numpy(emu):
    rng, ref = np.random.default_rng(0), NumpyBackend()
    table, ids = _rand(rng, 50, 24), np.array([3, 0, 49, 3, 7], dtype=np.int64)
    _close(_host(emu, emu.embedding(emu.upload(table), ids, 2.5)), ref.embedding(table, ids, 2.5), EXACT)
    x, delta, w = _rand(rng, 5, 24), _rand(rng, 5, 24), _rand(rng, 24)
    dx, dd, dw = emu.upload_activation(x), emu.upload_activation(delta), emu.upload(w)
    _close(_host(emu, emu.rms_norm(dx, dw, 1e-6)), ref.rms_norm(x, w, 1e-6), REDUCE)
    total, normed = emu.add_rms_norm(dx, dd, dw, 1e-5)
    ref_total, ref_normed = ref.add_rms_norm(x, delta, w, 1e-5)
    _close(_host(emu, total), ref_total, EXACT)
    _close(_host(emu, normed), ref_normed, REDUCE)
    _close(_host(emu, dx + dd), x + delta, EXACT)
    heads = _rand(rng, 5, 3, 8)  # QK-norm: rows = T * H
    _close(_host(emu, emu.rms_norm(emu.upload_activation(heads), emu.upload(w[:8]), 1e-6)),
           ref.rms_norm(heads, w[:8], 1e-6), REDUCE)
    gate_up = _rand(rng, 5, 32)
    for kind in ("silu", "gelu_tanh"):
        _close(_host(emu, emu.gated_activation(emu.upload_activation(gate_up), kind)),
               ref.gated_activation(gate_up, kind), REDUCE)
    assert {"embedding_f32", "add_rms_norm_f32", "gated_gelu_tanh_f32"} <= set(emu.emulator.launches)


def test_split_heads_rope_and_gather_rows_match_numpy(emu):
    rng, ref = np.random.default_rng(1), NumpyBackend()
    qkv = _rand(rng, 6, 64 + 32 + 32)
    parts = emu.split_heads(emu.upload_activation(qkv), (64, 32, 32), 16)
    for got, want in zip(parts, ref.split_heads(qkv, (64, 32, 32), 16)):
        _close(_host(emu, got), want, EXACT)
    positions = np.array([0, 1, 2, 9, 10, 30], dtype=np.int64)
    for rope_dims in (16, 8):  # full and partial rotary
        angles = np.outer(np.arange(40), np.arange(rope_dims // 2) * 0.3)
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        q = _rand(rng, 6, 4, 16)
        got = emu.rope(emu.upload_activation(q), positions, (emu.upload(cos), emu.upload(sin)), rope_dims)
        _close(_host(emu, got), ref.rope(q, positions, (cos, sin), rope_dims), REDUCE)
    x = _rand(rng, 6, 8)
    rows = np.array([5, 0, 2], dtype=np.int64)
    _close(_host(emu, emu.gather_rows(emu.upload_activation(x), rows)), x[rows], EXACT)


def _fp16(a):
    return a.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("rows", [3, 8, 40])  # matvec, matvec at its limit, gemm over a partial token tile
def test_fused_linear_of_mixed_type_parts_matches_numpy(emu, rows):
    """Q4_0 | Q8_0 | F16 | F32 parts of one fused matrix: one launch each into its column range of y (ld_y).
    The gemm is compared against a product of fp16-rounded operands, what its MMA consumes, at float32
    tolerance: a wrong column offset or fragment would be far outside it."""
    rng = np.random.default_rng(3)
    weights = [(Q.Q4_0, _rand(rng, 48, 64)), (Q.Q8_0, _rand(rng, 32, 64)), (Q.F16, _rand(rng, 16, 64)),
               (Q.F32, _rand(rng, 24, 64))]
    parts, dense = [], []
    for tensor_type, w in weights:
        raw = {Q.F16: lambda: w.astype(np.float16).view(np.uint8), Q.F32: lambda: w.view(np.uint8)}.get(
            tensor_type, lambda: quantize(w, tensor_type))()
        parts.append(LinearPart(tensor_type, raw, w.shape[0], 64, tensor_type.name))
        dense.append(dequantize(raw, tensor_type).reshape(w.shape).astype(np.float32))
    x, bias = _rand(rng, rows, 64), _rand(rng, 120)
    got = _host(emu, emu.linear(emu.upload_activation(x), emu.upload_linear_quantized(parts), emu.upload(bias)))
    w = np.concatenate(dense)
    if rows <= 8:
        _close(got, x @ w.T + bias, REDUCE)
    else:
        _close(got, _fp16(x).astype(np.float64) @ _fp16(w).T.astype(np.float64) + bias, REDUCE)
        _close(got, NumpyBackend().linear(x, w, bias), GEMM)
    kind = "matvec" if rows <= 8 else "gemm"
    assert [k for k in emu.emulator.launches if k.startswith(kind)] == [f"{kind}_q4_0", f"{kind}_q8_0",
                                                                        f"{kind}_f16", f"{kind}_f32"]


@pytest.mark.parametrize("rows", [1, 33])
def test_linear_f32_without_bias(emu, rows):
    rng = np.random.default_rng(2)
    x, w = _rand(rng, rows, 64), _rand(rng, 40, 64)
    got = _host(emu, emu.linear(emu.upload_activation(x), emu.upload_linear(w)))
    _close(got, NumpyBackend().linear(x, w, None), REDUCE if rows <= 8 else GEMM)


@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_over_scattered_blocks_with_gqa_matches_numpy(emu, window):
    layout = KVLayout(num_blocks=12, block_size=BLOCK, n_layers=2, n_kv_heads=2, head_dim=8)
    seqs = [(37, 5, np.array([7, 2, 9])), (16, 1, np.array([0])), (20, 20, np.array([11, 4]))]
    got, want, _ = _kv_case(emu, layout, seqs, window, np.random.default_rng(4))
    _close(got, want, REDUCE)
    assert "store_kv_f32" in emu.emulator.launches and "paged_attention_f32" in emu.emulator.launches


@pytest.mark.parametrize("window", [0, 21])
def test_split_attention_with_short_chunks_matches_numpy(emu, monkeypatch, window):
    """CHUNK_KEYS lowered so a short context splits into several chunks (some empty for the shorter
    sequence and, with a window, before its first visible key)."""
    from engine.backends import cuda_ops

    monkeypatch.setattr(cuda_ops, "CHUNK_KEYS", 16)
    layout = KVLayout(num_blocks=12, block_size=8, n_layers=2, n_kv_heads=2, head_dim=8)
    table = np.array([9, 3, 11, 0, 6, 1, 8])
    got, want, _ = _kv_case(emu, layout, [(53, 1, table), (20, 2, table[3:])], window, np.random.default_rng(6))
    _close(got, want, REDUCE)
    assert {"paged_attention_split_f32", "attention_combine_f32"} <= set(emu.emulator.launches)


def test_kv_block_copy_park_restore_read_write_round_trip(emu):
    layout = KVLayout(num_blocks=8, block_size=4, n_layers=2, n_kv_heads=2, head_dim=8)
    rng = np.random.default_rng(7)
    pool, host = emu.create_kv_pool(layout), emu.create_host_pool(KVLayout(6, 4, 2, 2, 8))
    blocks = {b: (_rand(rng, 2, 2, 4, 8), _rand(rng, 2, 2, 4, 8)) for b in range(8)}
    for b, (k, v) in blocks.items():
        emu.write_block(pool, b, k, v)
    for b, (k, v) in blocks.items():
        got_k, got_v = emu.read_block(pool, b)
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
    emu.copy_blocks(pool, [(1, 6), (2, 7)])
    for dst, src in ((6, 1), (7, 2)):
        for got, want in zip(emu.read_block(pool, dst), blocks[src]):
            np.testing.assert_array_equal(got, want)
    emu.park_blocks(pool, host, [(3, 4), (4, 5), (0, 0), (5, 2)])  # host slots 4, 5 form one run
    for host_block, source in ((4, 3), (5, 4), (0, 0), (2, 5)):
        for got, want in zip(emu.read_block(host, host_block), blocks[source]):
            np.testing.assert_array_equal(got, want)
    emu.restore_blocks(host, pool, [(4, 1), (5, 0), (0, 7)])
    for device_block, source in ((1, 3), (0, 4), (7, 0), (2, 2), (6, 1)):  # the last two untouched
        for got, want in zip(emu.read_block(pool, device_block), blocks[source]):
            np.testing.assert_array_equal(got, want)
    assert {"copy_kv_blocks_f32", "gather_kv_blocks_f32", "scatter_kv_blocks_f32"} <= set(emu.emulator.launches)


def _greedy(model, prompt, steps=8, **runner_args):
    """Greedy tokens after a prefill of `prompt` (a gemm step: more than 8 rows), then matvec decode steps;
    also the prefill's last logits."""
    runner = ModelRunner(model, num_blocks=16, block_size=8, **runner_args)
    seq = Sequence(list(prompt))
    runner.ensure_blocks(seq, len(prompt))
    logits = runner.step([(seq, len(prompt))])
    first, tokens = logits[-1].copy(), []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        seq.token_ids.append(tokens[-1])
        runner.ensure_blocks(seq, len(seq.token_ids))
        logits = runner.step([(seq, 1)])
    return tokens, first


@pytest.mark.parametrize("arch, quant", [("llama", "Q4_0"), ("gemma3", "Q8_0")])
def test_greedy_tokens_of_a_tiny_model_equal_numpy(emu, tmp_path, arch, quant):
    write_tiny_gguf(tmp_path / "m.gguf", arch, quant=quant)
    expected, expected_first = _greedy(load_model(tmp_path / "m.gguf", NumpyBackend())[0], range(3, 15))
    tokens, first = _greedy(load_model(tmp_path / "m.gguf", emu)[0], range(3, 15))
    _close(first, expected_first, GEMM)
    assert tokens == expected
    assert {f"gemm_{quant.lower()}", f"matvec_{quant.lower()}", "paged_attention_f32"} <= set(emu.emulator.launches)


def test_two_stage_pipeline_equals_numpy(emu, tmp_path):
    """layer_split=(1,): each stage on its own backend (for_stage), the hidden state handed over between them."""
    write_tiny_gguf(tmp_path / "m.gguf", "llama", quant="Q8_0")
    expected, _ = _greedy(load_model(tmp_path / "m.gguf", NumpyBackend())[0], range(3, 15), steps=6)
    tokens, _ = _greedy(load_model(tmp_path / "m.gguf", emu)[0], range(3, 15), steps=6, layer_split=(1,))
    assert tokens == expected
