"""Linear weights as raw GGUF rows (the quantised upload path), checked against the float32 path on the CPU."""
import logging
from dataclasses import replace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.gguf_file import GGUFFile
from engine.kv import layout_for
from engine.model import load_model
from engine.quant_weights import LinearPart, QuantizedLinearLoader, merge_parts, unpermute_rows
from engine.weights import unpermute_qk
from tests.support.tiny_gguf import write_tiny_gguf


def _dequant(part: LinearPart) -> np.ndarray:
    if part.tensor_type in (Q.F32, Q.F16):
        dtype = np.float32 if part.tensor_type == Q.F32 else np.float16
        return part.rows.view(dtype).astype(np.float32).reshape(part.out_dim, part.in_dim)
    return dequantize(part.rows, part.tensor_type).astype(np.float32).reshape(part.out_dim, part.in_dim)


class RecordingBackend(NumpyBackend):
    """Numpy backend with the quantised upload: records the parts, computes with their dequantised rows."""

    capabilities = replace(NumpyBackend.capabilities, quantized_linears=True)

    def __init__(self, supported=(Q.Q8_0, Q.Q4_0, Q.F32, Q.F16)):
        self.uploads: list[list[LinearPart]] = []
        self.supported = supported

    def supports_quant_type(self, tensor_type) -> bool:
        return tensor_type in self.supported

    def upload_linear_quantized(self, parts):
        self.uploads.append(list(parts))
        return np.concatenate([_dequant(p) for p in parts], axis=0)


def test_raw_rows_are_whole_blocks_per_output_row(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "llama", quant="Q4_0")
    f = GGUFFile(tmp_path / "m.gguf")
    tensor_type, rows = f.tensor_raw("blk.0.attn_q.weight")
    assert tensor_type == Q.Q4_0 and rows.shape == (64, 64 // 32 * 18) and rows.dtype == np.uint8
    np.testing.assert_array_equal(dequantize(rows, Q.Q4_0), f.tensor("blk.0.attn_q.weight"))


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "F16", "F32"])
def test_unpermuting_raw_rows_equals_unpermuting_the_dequantised_matrix(tmp_path, quant):
    write_tiny_gguf(tmp_path / "m.gguf", "llama", quant=quant)
    f = GGUFFile(tmp_path / "m.gguf")
    tensor_type, rows = f.tensor_raw("blk.0.attn_k.weight")
    part = LinearPart(tensor_type, unpermute_rows(rows, 2), 32, 64)
    np.testing.assert_array_equal(_dequant(part), unpermute_qk(f.tensor("blk.0.attn_k.weight"), 2))


def test_fused_qkv_of_one_type_is_one_part_in_q_k_v_order(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "llama", quant="Q8_0")
    backend = RecordingBackend()
    load_model(tmp_path / "m.gguf", backend)
    qkv = backend.uploads[0]
    assert [(p.tensor_type, p.out_dim, p.in_dim) for p in qkv] == [(Q.Q8_0, 64 + 32 + 32, 64)]
    f = GGUFFile(tmp_path / "m.gguf")
    expected = np.concatenate([unpermute_qk(f.tensor("blk.0.attn_q.weight"), 4),
                               unpermute_qk(f.tensor("blk.0.attn_k.weight"), 2), f.tensor("blk.0.attn_v.weight")])
    np.testing.assert_array_equal(_dequant(qkv[0]), expected)
    gate_up = backend.uploads[2]
    assert len(gate_up) == 1 and gate_up[0].out_dim == 2 * 128


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_model_on_raw_rows_gives_the_float_paths_logits(tmp_path, arch):
    write_tiny_gguf(tmp_path / "m.gguf", arch, quant="Q8_0")
    logits = []
    for backend in (NumpyBackend(), RecordingBackend()):
        model, _, _ = load_model(tmp_path / "m.gguf", backend)
        pool = backend.create_kv_pool(layout_for(model.config, 8, 16))
        logits.append(model.forward(build_batch([(list(range(3, 40)), 0, np.arange(8))], 16, all_logits=True), pool))
    np.testing.assert_array_equal(logits[0], logits[1])


def _write_mixed(path):
    """q (Q4_0), k and v (Q8_0) of a 2-head / 1-KV-head attention, 64 wide."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for name, rows, qt in (("q", 64, Q.Q4_0), ("k", 32, Q.Q8_0), ("v", 32, Q.Q8_0)):
        w.add_tensor(f"{name}.weight", quantize(rng.standard_normal((rows, 64)).astype(np.float32), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_mixed_types_become_one_part_per_run_of_a_type(tmp_path):
    _write_mixed(tmp_path / "mixed.gguf")
    f, backend = GGUFFile(tmp_path / "mixed.gguf"), RecordingBackend()
    fused = QuantizedLinearLoader(f, backend).linear(["q.weight", "k.weight", "v.weight"], [2, 1, 0])
    parts = backend.uploads[0]
    assert [(p.tensor_type, p.out_dim, p.name) for p in parts] == [(Q.Q4_0, 64, "q.weight"),
                                                                   (Q.Q8_0, 64, "k.weight+v.weight")]
    expected = np.concatenate([unpermute_qk(f.tensor("q.weight"), 2), unpermute_qk(f.tensor("k.weight"), 1),
                               f.tensor("v.weight")])
    np.testing.assert_array_equal(fused, expected)


def test_unsupported_type_falls_back_to_f16_rows_with_a_warning(tmp_path, caplog):
    _write_mixed(tmp_path / "mixed.gguf")
    f, backend = GGUFFile(tmp_path / "mixed.gguf"), RecordingBackend(supported=(Q.Q8_0, Q.F16))
    with caplog.at_level(logging.WARNING, logger="strata.weights"):
        QuantizedLinearLoader(f, backend).linear(["q.weight", "k.weight"])
    assert "tensor q.weight: no kernel for type Q4_0 on this backend, uploading it dequantised as F16" in caplog.text
    q_part, k_part = backend.uploads[0]
    assert q_part.tensor_type == Q.F16 and q_part.rows.shape == (64, 128) and k_part.tensor_type == Q.Q8_0
    np.testing.assert_allclose(_dequant(q_part), f.tensor("q.weight"), rtol=1e-3, atol=1e-3)


def test_merge_keeps_order_and_only_joins_neighbours():
    def part(t, n):
        return LinearPart(t, np.full((n, 4), n, np.uint8), n, 32, f"p{n}")

    merged = merge_parts([part(Q.Q8_0, 1), part(Q.Q8_0, 2), part(Q.Q4_0, 3), part(Q.Q8_0, 4)])
    assert [(p.tensor_type, p.out_dim) for p in merged] == [(Q.Q8_0, 3), (Q.Q4_0, 3), (Q.Q8_0, 4)]
    np.testing.assert_array_equal(merged[0].rows[:, 0], [1, 2, 2])
