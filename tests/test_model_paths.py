"""The batched paged forward pass against itself and against a naive dense reference, per architecture.

Tiny random-weight GGUFs (tests/support/tiny_gguf.py) make these run in milliseconds. Tolerances are float32
round-off: the naive reference runs in float64.
"""
import numpy as np
import pytest

from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.kv import layout_for
from engine.model import load_model
from tests.support.naive_reference import naive_logits
from tests.support.tiny_gguf import ARCHS, write_tiny_gguf

BLOCK = 4
ATOL = 2e-4


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf"
    write_tiny_gguf(path, request.param, seed=1)
    model, gguf, _ = load_model(path, NumpyBackend())
    return model, gguf


def _prompt(n, seed=0, vocab=200):
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _pool(model, num_blocks=64):
    return model.backend.create_kv_pool(layout_for(model.config, num_blocks, BLOCK))


def _full(model, ids, table=None):
    table = np.arange(64) if table is None else table
    return model.forward(build_batch([(ids, 0, table)], BLOCK, all_logits=True), _pool(model))


def test_matches_naive_reference(tiny):
    model, gguf = tiny
    ids = _prompt(23)
    expected = naive_logits(gguf, model.config, ids)
    np.testing.assert_allclose(_full(model, ids), expected, atol=ATOL, rtol=1e-4)


def test_sliding_window_is_applied_beyond_the_window(tmp_path):
    path = tmp_path / "gemma3.gguf"
    write_tiny_gguf(path, "gemma3", seed=3, sliding_window=5)
    model, gguf, _ = load_model(path, NumpyBackend())
    assert model.config.layer_is_sliding == (True,) * 5 + (False,)
    ids = _prompt(3 * model.config.sliding_window + 5, seed=3)
    table = np.array([9, 2, 3, 4, 30, 31, 40, 41], dtype=np.int32)  # runs split across the window edge
    expected = naive_logits(gguf, model.config, ids)
    np.testing.assert_allclose(_full(model, ids, table), expected, atol=ATOL, rtol=1e-4)
    pool = _pool(model)  # decode steps far past the window read only its last keys
    steps = [model.forward(build_batch([(ids[:8], 0, table)], BLOCK), pool)]
    steps += [model.forward(build_batch([(ids[p : p + 1], p, table)], BLOCK), pool) for p in range(8, len(ids))]
    np.testing.assert_allclose(np.concatenate(steps), expected[7:], atol=ATOL, rtol=1e-4)


def test_batched_equals_one_by_one(tiny):
    model, _ = tiny
    prompts = [_prompt(n, seed=n) for n in (5, 13, 1, 9)]
    pool = _pool(model)
    tables = [np.arange(i * 8, i * 8 + 8) for i in range(len(prompts))]
    batched = model.forward(build_batch(list(zip(prompts, [0] * 4, tables)), BLOCK, all_logits=True), pool)
    singles = np.concatenate([_full(model, p) for p in prompts])
    np.testing.assert_allclose(batched, singles, atol=1e-5, rtol=1e-5)


def test_paged_equals_contiguous(tiny):
    model, _ = tiny
    ids = _prompt(30, seed=7)
    scattered = np.array([17, 3, 40, 41, 9, 0, 63, 22], dtype=np.int32)  # non-contiguous runs
    np.testing.assert_allclose(_full(model, ids, scattered), _full(model, ids), atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_shot(tiny):
    model, _ = tiny
    ids = _prompt(29, seed=11)
    pool, table = _pool(model), np.array([5, 6, 2, 30, 31, 32, 7, 8])
    chunks, start = [], 0
    for size in (7, 1, 12, 9):  # chunk borders inside and across blocks
        chunks.append(model.forward(build_batch([(ids[start : start + size], start, table)], BLOCK, True), pool))
        start += size
    np.testing.assert_allclose(np.concatenate(chunks), _full(model, ids), atol=1e-5, rtol=1e-5)


def test_decode_after_prefill_equals_full_prefill(tiny):
    model, _ = tiny
    ids = _prompt(20, seed=5)
    pool, table = _pool(model), np.arange(10, 20)
    logits = [model.forward(build_batch([(ids[:12], 0, table)], BLOCK), pool)]
    for pos in range(12, 20):
        logits.append(model.forward(build_batch([(ids[pos : pos + 1], pos, table)], BLOCK), pool))
    expected = _full(model, ids)[11:]
    np.testing.assert_allclose(np.concatenate(logits), expected, atol=1e-5, rtol=1e-5)


def test_mixed_prefill_and_decode_in_one_step(tiny):
    model, _ = tiny
    a, b = _prompt(10, seed=1), _prompt(14, seed=2)
    pool = _pool(model)
    ta, tb = np.arange(0, 8), np.arange(8, 16)
    model.forward(build_batch([(a[:9], 0, ta)], BLOCK), pool)  # a already prefilled, decodes its 10th
    step = model.forward(build_batch([(a[9:], 9, ta), (b, 0, tb)], BLOCK), pool)
    np.testing.assert_allclose(step[0], _full(model, a)[-1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(step[1], _full(model, b)[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantised_weights_match_naive_reference(tmp_path, quant):
    path = tmp_path / f"llama-{quant}.gguf"
    write_tiny_gguf(path, "llama", seed=2, quant=quant, embd_quant="Q8_0")
    model, gguf, _ = load_model(path, NumpyBackend())
    ids = _prompt(11, seed=4)
    np.testing.assert_allclose(_full(model, ids), naive_logits(gguf, model.config, ids), atol=ATOL, rtol=1e-4)
