"""The fused decode step on integer activations (cpu/int8_matvec.py) against the float32 one, tiny models.

The same models and schedule as tests/test_cpu_fused_decode.py. The kernels themselves are checked against
gguf's dequantisation in tests/test_cpu_int8_matvec.py, the real models against the transformers
references in test_reference_smollm2.py / test_reference_gemma3.py (int16, the default) and against the
unfused path in test_cpu_fused_reference.py.
"""
import numpy as np
import pytest

from engine.backends.cpu import fused_decoder as cpu_fused_decode
from engine.backends.cpu import gguf_dequant as d
from engine.backends.cpu.fused_decoder import int8_refusal
from tests.support.fused_decode_runs import CASES, PROMPT_LENS, case_id, decode_logits, open_case

# Largest |logit(int16) - logit(f32)| on these models: measured 7.9e-4 (llama Q4_1, logits up to 6.1);
# int8: 0.28 there (4.5% of the largest logit; 0.05-0.09 on the others). 5x and 2x margins.
INT16_BOUND = 4e-3
INT8_RELATIVE_BOUND = 0.1


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def model(request, tmp_path_factory):
    return open_case(request.param, tmp_path_factory)


def _quantisable(model) -> bool:
    return int8_refusal(model) is None


@pytest.fixture
def integer_steps(monkeypatch):
    """Every fused step of up to 8 tokens on the integer kernels (by default only 1-token steps are)."""
    monkeypatch.setattr(cpu_fused_decode, "INT_MAX_TOKENS", 8)


def test_int16_activations_keep_ids_and_logits_of_the_float_path(model, integer_steps):
    f32, int16 = decode_logits(model, True), decode_logits(model, True, activations="int16")
    for a, b in zip(int16, f32):
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
        assert np.max(np.abs(a - b)) <= INT16_BOUND, np.max(np.abs(a - b))
    if _quantisable(model):  # the integer path ran: its rounding shows (a float-only model gives 0)
        assert max(np.max(np.abs(a - b)) for a, b in zip(int16, f32)) > 0


def test_int8_activations_stay_near_the_float_path(model, integer_steps):
    f32, int8 = decode_logits(model, True), decode_logits(model, True, activations="int8")
    scale = max(np.max(np.abs(a)) for a in f32)
    for a, b in zip(int8, f32):
        assert np.max(np.abs(a - b)) <= INT8_RELATIVE_BOUND * scale


def test_integer_batched_decode_equals_one_by_one_exactly(model, integer_steps):
    if not _quantisable(model):
        return  # F16 weights: no integer kernel, the float path (test_cpu_fused_decode.py) ran
    together = decode_logits(model, True, activations="int16")
    for a, b in zip(together, decode_logits(model, True, activations="int16", together=False)):
        np.testing.assert_array_equal(a, b)  # per-token scales and the same loops for every row


def test_integer_paged_decode_equals_contiguous(model, integer_steps):
    contiguous = decode_logits(model, True, token_by_token=True, activations="int16")
    for a, b in zip(contiguous, decode_logits(model, True, token_by_token=True, shuffle_blocks=True,
                                              activations="int16")):
        np.testing.assert_array_equal(a, b)


def test_steps_of_several_tokens_take_the_integer_kernels_each_token_alone(model):
    """Three sequences decode together (INT_MAX_TOKENS covers every fused step): each token's products are
    its own (per-token activation scales, the same loops), so together equals one by one bit for bit, and
    differs from float activations where the weights take integers."""
    assert cpu_fused_decode.INT_MAX_TOKENS >= len(PROMPT_LENS)
    if not _quantisable(model):
        pytest.skip("float weights: the float kernels run (test_float_weights_refuse_integer_activations)")
    together = decode_logits(model, True, activations="int16")
    for a, b in zip(together, decode_logits(model, True, together=False, activations="int16")):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(a != b) for a, b in zip(together, decode_logits(model, True)))


def test_float_weights_refuse_integer_activations(model):
    kinds = {k for m in [model.weights.output] + [lw.wqkv for lw in model.weights.layers] for k, _, _ in m.parts}
    integer = {d.Q4_0, d.Q4_1, d.Q5_0, d.Q5_1, d.Q8_0, d.Q4_K, d.Q5_K, d.Q6_K}
    assert (int8_refusal(model) is None) == (kinds <= integer)


def test_prepare_decode_builds_the_decoder_the_steps_then_use(model):
    backend = model.backend
    backend.activations = "int16"
    backend._fused.clear()
    backend.prepare_decode(model)
    decoder = backend._fused[model]
    assert (decoder is not None) and ("int" in decoder.linears) == _quantisable(model)
    decode_logits(model, True, activations="int16")
    assert backend._fused[model] is decoder  # not rebuilt at the first step
