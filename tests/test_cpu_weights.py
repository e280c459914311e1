"""`--cpu-weights quantized`: the numpy backend on raw GGUF blocks gives the float32 path's logits (up to
summation order), keeps the token table and a tied head as one raw object, and works under a layer split
and the pipeline's concurrent stage threads."""
import logging

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from api.config import ServerConfig
from engine.backends.cpu.backend import QuantizedNumpyBackend
from engine.backends.cpu.quant_linear import QuantLinear
from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.gguf_file import GGUFFile
from engine.kv import layout_for
from engine.loader import create_backend
from engine.model import load_model
from engine.quant_weights import QuantizedLinearLoader
from engine.sequence import ModelRunner
from engine.tokenizer import Tokenizer
from tests.support.pipeline_runs import random_prompt, run_conversations
from tests.support.reference_helpers import chunked_step_logits
from tests.support.tiny_gguf import write_tiny_gguf


def _logits(path, backend):
    model, _, info = load_model(path, backend)
    pool = backend.create_kv_pool(layout_for(model.config, 8, 16))
    batch = build_batch([(list(range(3, 40)), 0, np.arange(8))], 16, all_logits=True)  # 37 rows: tiled path
    prefill = model.forward(batch, pool)
    decode = model.forward(build_batch([([41], 37, np.arange(8))], 16), pool)  # one row: the kernel
    return np.concatenate([prefill, decode]), model, info


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1", "Q5_0", "BF16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_quantized_weights_give_the_float32_logits(tmp_path, arch, quant):
    write_tiny_gguf(tmp_path / "m.gguf", arch, quant=quant, embd_quant=quant)
    expected, _, f32_info = _logits(tmp_path / "m.gguf", NumpyBackend())
    got, model, info = _logits(tmp_path / "m.gguf", QuantizedNumpyBackend())
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    assert isinstance(model.weights.layers[0].wqkv, QuantLinear)
    assert info.weight_bytes < f32_info.weight_bytes


def test_tied_head_is_the_raw_embedding_table_itself(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", "llama", quant="Q8_0", embd_quant="Q8_0", tied=True)
    model, gguf_file, _ = load_model(tmp_path / "m.gguf", QuantizedNumpyBackend())
    table = model.weights.embedding
    assert table is model.weights.output and isinstance(table, QuantLinear)
    assert np.shares_memory(table.parts[0][1], gguf_file.tensor_raw("token_embd.weight")[1])  # the mmap


def test_a_type_without_a_cpu_kernel_becomes_exact_f32_rows(tmp_path, caplog):
    class NoQ4(QuantizedNumpyBackend):
        def supports_quant_type(self, tensor_type):
            return tensor_type != Q.Q4_0

    write_tiny_gguf(tmp_path / "m.gguf", "llama", quant="Q4_0")
    f = GGUFFile(tmp_path / "m.gguf")
    with caplog.at_level(logging.WARNING, logger="strata.weights"):
        linear = QuantizedLinearLoader(f, NoQ4()).linear(["blk.0.attn_v.weight"])
    assert "no kernel for type Q4_0 on this backend, uploading it dequantised as F32" in caplog.text
    np.testing.assert_array_equal(linear.dequantize(), f.tensor("blk.0.attn_v.weight"))


@pytest.fixture(scope="module")
def tiny_quantized(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "llama.gguf"
    write_tiny_gguf(path, "llama", seed=5, n_ctx=512, n_layer=4, quant="Q4_1", embd_quant="Q8_0")
    model, _, _ = load_model(path, QuantizedNumpyBackend())
    return model, Tokenizer.from_gguf_fields(GGUFFile(path).fields)


@pytest.mark.parametrize("split", [(2,), (1, 3)])
def test_a_split_quantized_model_computes_bit_identical_logits(tiny_quantized, split):
    model, _ = tiny_quantized
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 9)]
    # A split model's stages run the unfused layers (the fused decode step takes one-stage models only,
    # tests/test_cpu_fused_decode.py): bit-identity holds against the unfused whole.
    model.backend.fused_decode = False
    whole = chunked_step_logits(ModelRunner(model, 32, 4), prompts)
    model.backend.fused_decode = True
    parts = chunked_step_logits(ModelRunner(model, 32, 4, layer_split=split), prompts)
    assert all(np.array_equal(a, b) for a, b in zip(whole, parts))


def test_pipelined_stages_calling_kernels_at_once_change_no_token(tiny_quantized):
    prompts = [random_prompt(n, seed=n) for n in (3, 21, 30, 9)]
    expected, _, _, _ = run_conversations(tiny_quantized, (), 1, prompts)
    tokens, reasons, peak, _ = run_conversations(tiny_quantized, (1, 3), 3, prompts)
    assert tokens == expected and reasons == ["length"] * 4 and peak == 3


def test_cpu_weights_flag_picks_the_backend_and_rejects_other_values():
    assert ServerConfig().cpu_weights == "quantized"
    assert type(create_backend("numpy", cpu_weights="f32")) is NumpyBackend
    assert type(create_backend("numpy", cpu_weights="quantized")) is QuantizedNumpyBackend
    for value, activations in [("quantized", "int16"), ("quantized-int8act", "int8"), ("quantized-f32act", "f32")]:
        assert create_backend("numpy", cpu_weights=value).activations == activations
        assert ServerConfig(cpu_weights=value).cpu_weights == value
    with pytest.raises(ValueError, match="--cpu-weights 'int4' is not one of: quantized, quantized-int8act, "
                                         "quantized-f32act, f32"):
        ServerConfig(cpu_weights="int4")
    with pytest.raises(ValueError, match="unknown --cpu-weights"):
        create_backend("numpy", cpu_weights="int4")
