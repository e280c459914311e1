"""The batched paged forward pass against itself and against a naive dense reference, per architecture.

Tiny random-weight GGUFs (tests/support/tiny_gguf.py) make these run in milliseconds. Tolerances are float32
round-off: the naive reference runs in float64.
"""
import numpy as np
import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.model import load_model
from tests.support import path_equalities
from tests.support.naive_reference import naive_logits
from tests.support.path_equalities import BLOCK, full_logits, kv_pool, random_ids
from tests.support.tiny_gguf import ARCHS, write_tiny_gguf

ATOL = 2e-4


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf"
    write_tiny_gguf(path, request.param, seed=1)
    model, gguf, _ = load_model(path, NumpyBackend())
    return model, gguf


def test_matches_naive_reference(tiny):
    model, gguf = tiny
    ids = random_ids(23)
    expected = naive_logits(gguf, model.config, ids)
    np.testing.assert_allclose(full_logits(model, ids), expected, atol=ATOL, rtol=1e-4)


def test_sliding_window_is_applied_beyond_the_window(tmp_path):
    path = tmp_path / "gemma3.gguf"
    write_tiny_gguf(path, "gemma3", seed=3, sliding_window=5)
    model, gguf, _ = load_model(path, NumpyBackend())
    assert model.config.layer_is_sliding == (True,) * 5 + (False,)
    ids = random_ids(3 * model.config.sliding_window + 5, seed=3)
    table = np.array([9, 2, 3, 4, 30, 31, 40, 41], dtype=np.int32)  # runs split across the window edge
    expected = naive_logits(gguf, model.config, ids)
    np.testing.assert_allclose(full_logits(model, ids, table), expected, atol=ATOL, rtol=1e-4)
    pool = kv_pool(model)  # decode steps far past the window read only its last keys
    steps = [model.forward(build_batch([(ids[:8], 0, table)], BLOCK), pool)]
    steps += [model.forward(build_batch([(ids[p : p + 1], p, table)], BLOCK), pool) for p in range(8, len(ids))]
    np.testing.assert_allclose(np.concatenate(steps), expected[7:], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantised_weights_match_naive_reference(tmp_path, quant):
    path = tmp_path / f"llama-{quant}.gguf"
    write_tiny_gguf(path, "llama", seed=2, quant=quant, embd_quant="Q8_0")
    model, gguf, _ = load_model(path, NumpyBackend())
    ids = random_ids(11, seed=4)
    np.testing.assert_allclose(full_logits(model, ids), naive_logits(gguf, model.config, ids), atol=ATOL, rtol=1e-4)


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
