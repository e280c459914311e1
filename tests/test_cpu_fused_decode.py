"""The fused decode step (engine/backends/cpu/fused_decoder.py) against the unfused numpy path it replaces.

Tiny random models of every dense arch the fused step runs (llama, qwen2 with QKV bias, qwen3 with QK-norm,
gemma3 with its post norms, GELU and sliding-window layers), quantised to block types it dots directly and
to ones it decodes first. Three sequences of different lengths decode together; gemma3's window (6) is
shorter than every context, so the window is exercised.
"""
import numpy as np
import pytest

from engine.backends.cpu.fused_decoder import FusedDecoder, int8_refusal
from engine.kv import KVLayout
from tests.support.fused_decode_runs import CASES, case_id, decode_logits, open_case

# Largest |fused - unfused| logit on these models: measured 1.7e-5 (llama Q4_1, logits up to 6; batched vs one
# by one 2.4e-6): float32 sums in another order.
LOGIT_BOUND = 1e-4
# The same on a float16 pool with every K/V row written by the path under test: measured 3.8e-4 (llama Q4_1). A
# value whose float32 sums differ in the last bit can round to the neighbouring float16 (2^-11 relative).
F16_LOGIT_BOUND = 2e-3


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def model(request, tmp_path_factory):
    return open_case(request.param, tmp_path_factory)


def test_fused_decode_matches_the_unfused_path(model):
    fused, unfused = decode_logits(model, True), decode_logits(model, False)
    for a, b in zip(fused, unfused):
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
        assert np.max(np.abs(a - b)) <= LOGIT_BOUND, np.max(np.abs(a - b))


def test_fused_decode_on_a_float16_pool_matches_the_unfused_path(model):
    """The step reads and writes float16 K/V through the pool's bits (cpu/half.py), the bytes the unfused path
    stores (tests/test_cpu_half.py); K/V written token by token by either path."""
    fused = decode_logits(model, True, token_by_token=True, kv_type="f16")
    unfused = decode_logits(model, False, token_by_token=True, kv_type="f16")
    for a, b in zip(fused, unfused):
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
        assert np.max(np.abs(a - b)) <= F16_LOGIT_BOUND, np.max(np.abs(a - b))


def test_fused_batched_decode_equals_one_by_one(model):
    for a, b in zip(decode_logits(model, True), decode_logits(model, True, together=False)):
        assert np.max(np.abs(a - b)) <= LOGIT_BOUND


@pytest.mark.parametrize("activations", ["f32", "int16"])
def test_fused_decode_is_bitwise_the_same_for_any_number_of_workers(model, activations, monkeypatch):
    """Each work unit is computed whole by one worker (cpu/step_sync.py), so who takes which changes nothing; 5
    workers on at most 2 threads also shows the step cannot wait for a worker that never starts."""
    if activations != "f32" and int8_refusal(model):
        pytest.skip(int8_refusal(model))
    runs = []
    for workers in (1, 2, 5):
        monkeypatch.setattr(FusedDecoder, "workers", workers)
        runs.append(decode_logits(model, True, activations=activations))
    for a, b, c in zip(*runs):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_fused_paged_decode_equals_contiguous(model):
    contiguous = decode_logits(model, True, token_by_token=True)
    for a, b in zip(contiguous, decode_logits(model, True, token_by_token=True, shuffle_blocks=True)):
        np.testing.assert_array_equal(a, b)  # the same operations in the same order, other addresses


def test_fused_decode_is_taken_for_decode_steps_only():
    pool = type("Pool", (), {"layout": KVLayout(8, 4, 1, 1, 16, "f32")})()
    f16_pool = type("Pool", (), {"layout": KVLayout(8, 4, 1, 1, 16, "f16")})()
    int8_pool = type("Pool", (), {"layout": KVLayout(8, 4, 1, 1, 16, "int8")})()
    runner_batch = _batch([1, 1, 1])
    assert FusedDecoder.accepts(runner_batch, pool)
    assert FusedDecoder.accepts(runner_batch, f16_pool)
    assert not FusedDecoder.accepts(_batch([1, 3]), pool)  # a prefill chunk in the batch
    assert not FusedDecoder.accepts(_batch([1] * 9), pool)  # more rows than the few-row kernels take
    assert not FusedDecoder.accepts(runner_batch, int8_pool)


def _batch(query_lens):
    from engine.batch import build_batch

    return build_batch([([5] * n, 4, np.arange(4)) for n in query_lens], block_size=4)
