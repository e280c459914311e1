"""The paged engine against itself on tiny qwen3moe and gpt-oss GGUFs: the path equalities that
tests/test_model_paths.py runs on the dense architectures (tests/support/path_equalities.py) and bit-identical
split pipeline stages. The independent reference is tests/test_moe_reference.py (transformers)."""
import numpy as np
import pytest

from engine.backends.cpu.backend import QuantizedNumpyBackend
from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.kv import layout_for
from engine.model import load_model
from engine.sequence import ModelRunner
from tests.support import path_equalities
from tests.support.reference_helpers import chunked_step_logits
from tests.support.tiny_moe_gguf import MOE_ARCHS, write_tiny_moe_gguf

# The dense tests' 1e-5 bounds float32 summation-order differences; the gain of the tiny model sets how
# far those grow. Router weights of std 0.3 (not 1.0): the top-k weights' sensitivity to the router
# logits scales with them while the odds of a top-k flip do not; gpt-oss weights of std 0.1 (not 0.2):
# its biases and (up + 1) gating grow the residual stream ~3x per layer. Measured on gpt-oss paged vs
# contiguous: 1.4e-4 at the defaults, 4e-6 at these; seeds 3-7 all pass. gpt-oss slides over 5 tokens so
# the tests' 20-30 token prompts cross the window. tests/test_moe_reference.py runs the defaults.
_OVERRIDES = {"qwen3moe": {"router_scale": 0.3}, "gpt-oss": {"sliding_window": 5, "weight_scale": 0.1, "router_scale": 0.3}}


@pytest.fixture(scope="module", params=[(a, b) for a in MOE_ARCHS for b in ("f32", "quantized")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tiny(request, tmp_path_factory):
    arch, weights = request.param
    path = tmp_path_factory.mktemp("tiny_moe") / f"{arch}.gguf"
    quant = {"quant": "Q8_0", "expert_quant": "MXFP4" if arch == "gpt-oss" else "Q8_0"} if weights == "quantized" else {}
    write_tiny_moe_gguf(path, arch, seed=3, **_OVERRIDES[arch], **quant)
    backend = QuantizedNumpyBackend() if weights == "quantized" else NumpyBackend()
    model, gguf, _ = load_model(path, backend)
    return model, gguf


def test_batched_equals_one_by_one(tiny):
    path_equalities.batched_equals_one_by_one(tiny)


def test_paged_equals_contiguous(tiny):
    path_equalities.paged_equals_contiguous(tiny)


def test_chunked_prefill_equals_one_shot(tiny):
    path_equalities.chunked_prefill_equals_one_shot(tiny)


def test_decode_after_prefill_equals_full_prefill(tiny):
    path_equalities.decode_after_prefill_equals_full_prefill(tiny)


def test_mixed_prefill_and_decode_in_one_step(tiny):
    path_equalities.mixed_prefill_and_decode_in_one_step(tiny)


@pytest.mark.parametrize("split", [(1,), (1, 2)])
def test_a_split_moe_model_computes_bit_identical_logits(tiny, split):
    model, _ = tiny
    prompts = [np.random.default_rng(n).integers(3, 250, size=n).tolist() for n in (13, 7, 22)]
    whole = chunked_step_logits(ModelRunner(model, 32, 4), prompts)
    parts = chunked_step_logits(ModelRunner(model, 32, 4, layer_split=split), prompts)
    assert all(np.array_equal(a, b) for a, b in zip(whole, parts))


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("weights", ["f32", "quantized"])
def test_a_fused_gate_up_expert_tensor_gives_the_split_tensors_logits(tmp_path, arch, weights):
    """llama.cpp's newer converters may write ffn_gate_up_exps ([E, 2F, d], gate rows first) instead of
    ffn_gate_exps + ffn_up_exps: the same weights must compute the same thing."""
    backend = QuantizedNumpyBackend if weights == "quantized" else NumpyBackend
    ids = np.random.default_rng(4).integers(3, 250, size=17).tolist()
    logits = []
    for fused in (False, True):
        path = tmp_path / f"{arch}-{fused}.gguf"
        write_tiny_moe_gguf(path, arch, seed=6, fused_gate_up=fused, expert_quant="Q8_0")
        model, gguf, _ = load_model(path, backend())
        assert gguf.has_tensor("blk.0.ffn_gate_up_exps.weight") == fused
        pool = model.backend.create_kv_pool(layout_for(model.config, 16, 4))
        logits.append(model.forward(build_batch([(ids, 0, np.arange(16))], 4, all_logits=True), pool))
    # One 2F-row product against two F-row ones: the kernels (BLAS tiles, few-row units) choose their vector
    # paths, so the float32 summation order, by row count and CPU. Measured: within 1e-6 on the AVX-512
    # machines, 2.6e-6 on an AVX2 EPYC (session 7, before and after that session's changes); a wrong
    # gate / up split moves logits by O(0.1).
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-6, atol=1e-5)
