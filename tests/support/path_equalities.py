"""Path equalities of the paged forward pass, each a check on a `tiny` = (model, gguf) that a test module
parametrises: batched == one by one, paged == contiguous, chunked prefill == one shot, decode == prefill, and
prefill and decode in one step. tests/test_model_paths.py runs them on the dense architectures,
tests/test_moe_paths.py on the MoE ones."""
import numpy as np

from engine.batch import build_batch
from engine.kv import layout_for

BLOCK = 4


def random_ids(n, seed=0, vocab=200):
    """n token ids in 3..vocab-1, the same for the same seed."""
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def kv_pool(model, num_blocks=64):
    """A fresh K/V pool of BLOCK-token blocks on the model's backend."""
    return model.backend.create_kv_pool(layout_for(model.config, num_blocks, BLOCK))


def full_logits(model, ids, table=None):
    """Every position's logits of `ids` prefilled in one step into a fresh pool (blocks 0.. by default)."""
    table = np.arange(64) if table is None else table
    return model.forward(build_batch([(ids, 0, table)], BLOCK, all_logits=True), kv_pool(model))


def batched_equals_one_by_one(tiny):
    model, _ = tiny
    prompts = [random_ids(n, seed=n) for n in (5, 13, 1, 9)]
    pool = kv_pool(model)
    tables = [np.arange(i * 8, i * 8 + 8) for i in range(len(prompts))]
    batched = model.forward(build_batch(list(zip(prompts, [0] * 4, tables)), BLOCK, all_logits=True), pool)
    singles = np.concatenate([full_logits(model, p) for p in prompts])
    np.testing.assert_allclose(batched, singles, atol=1e-5, rtol=1e-5)


def paged_equals_contiguous(tiny):
    model, _ = tiny
    ids = random_ids(30, seed=7)
    scattered = np.array([17, 3, 40, 41, 9, 0, 63, 22], dtype=np.int32)  # non-contiguous runs
    np.testing.assert_allclose(full_logits(model, ids, scattered), full_logits(model, ids), atol=1e-5, rtol=1e-5)


def chunked_prefill_equals_one_shot(tiny):
    model, _ = tiny
    ids = random_ids(29, seed=11)
    pool, table = kv_pool(model), np.array([5, 6, 2, 30, 31, 32, 7, 8])
    chunks, start = [], 0
    for size in (7, 1, 12, 9):  # chunk borders inside and across blocks
        chunks.append(model.forward(build_batch([(ids[start : start + size], start, table)], BLOCK, True), pool))
        start += size
    np.testing.assert_allclose(np.concatenate(chunks), full_logits(model, ids), atol=1e-5, rtol=1e-5)


def decode_after_prefill_equals_full_prefill(tiny):
    model, _ = tiny
    ids = random_ids(20, seed=5)
    pool, table = kv_pool(model), np.arange(10, 20)
    logits = [model.forward(build_batch([(ids[:12], 0, table)], BLOCK), pool)]
    for pos in range(12, 20):
        logits.append(model.forward(build_batch([(ids[pos : pos + 1], pos, table)], BLOCK), pool))
    expected = full_logits(model, ids)[11:]
    np.testing.assert_allclose(np.concatenate(logits), expected, atol=1e-5, rtol=1e-5)


def mixed_prefill_and_decode_in_one_step(tiny):
    model, _ = tiny
    a, b = random_ids(10, seed=1), random_ids(14, seed=2)
    pool = kv_pool(model)
    ta, tb = np.arange(0, 8), np.arange(8, 16)
    model.forward(build_batch([(a[:9], 0, ta)], BLOCK), pool)  # a already prefilled, decodes its 10th
    step = model.forward(build_batch([(a[9:], 9, ta), (b, 0, tb)], BLOCK), pool)
    np.testing.assert_allclose(step[0], full_logits(model, a)[-1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(step[1], full_logits(model, b)[-1], atol=1e-5, rtol=1e-5)
