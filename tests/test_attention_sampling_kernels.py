"""Paged attention (direct and split-K) and sampling kernels against the numpy backend's attention and
engine/sampling.py's filters, run on the CPU (tests/support/kernel_emulator.py) and on a GPU where there is one."""
from __future__ import annotations

import numpy as np
import pytest

from cuda_kernels.attention import num_chunks
from cuda_kernels.sampling import mask_words, philox_uniform
from engine.backends.reference.backend import NumpyBackend
from engine.batch import build_batch
from engine.kv import KVLayout

REF = NumpyBackend()


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def attention_case(H, KVH, hd, block_size=4):
    """Three sequences over scattered blocks: a prefill chunk mid-prompt, a decode step, a first chunk."""
    layout = KVLayout(num_blocks=12, block_size=block_size, n_layers=1, n_kv_heads=KVH, head_dim=hd)
    pool = REF.create_kv_pool(layout)
    pool.k[...], pool.v[...] = rand(*pool.k.shape, seed=1), rand(*pool.v.shape, seed=2)
    tables = [np.array([7, 2, 9]), np.array([0, 11, 3, 5]), np.array([10])]
    batch = build_batch([([1] * 5, 6, tables[0]), ([1], 13, tables[1]), ([1] * 3, 0, tables[2])], block_size)
    max_blocks = max(len(t) for t in tables)
    block_tables = np.zeros((3, max_blocks), np.int32)
    for s, table in enumerate(tables):
        block_tables[s, : len(table)] = table
    token_seq = np.repeat(np.arange(3, dtype=np.int32), [seq.query_len for seq in batch.seqs])
    q = rand(batch.num_tokens, H, hd, seed=3)
    args = dict(
        q=q, pool_k=np.ascontiguousarray(pool.k[0]), pool_v=np.ascontiguousarray(pool.v[0]), token_seq=token_seq,
        token_pos=batch.positions.astype(np.int32), block_tables=block_tables, max_blocks=max_blocks,
        T=batch.num_tokens, H=H, KVH=KVH, hd=hd, block_size=block_size, num_slots=layout.num_slots, seg_rows=0,
        scale=float(hd) ** -0.5,
    )
    return pool, batch, args


@pytest.mark.parametrize("H, KVH, hd", [(4, 2, 80), (2, 2, 64), (2, 1, 256)])
@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_matches_numpy(kernel_runner, H, KVH, hd, window):
    pool, batch, args = attention_case(H, KVH, hd)
    out = np.full((batch.num_tokens, H * hd), np.nan, np.float32)
    kernel_runner("attention").launch("paged_attention_f32", out=out, window=window, **args)
    want = REF.attention(args["q"], pool, 0, batch, args["scale"], window)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 5])
def test_split_attention_and_combine_match_numpy(kernel_runner, window):
    pool, batch, args = attention_case(4, 2, 80)
    lib = kernel_runner("attention")
    n_chunks = num_chunks(args["max_blocks"], args["block_size"], chunk_keys=3, window=window)
    rows = batch.num_tokens * 4
    part_out = np.full((rows, n_chunks, 80), np.nan, np.float32)
    part_max, part_sum = np.full((rows, n_chunks), np.nan, np.float32), np.full((rows, n_chunks), np.nan, np.float32)
    lib.launch("paged_attention_split_f32", out=None, window=window, part_out=part_out, part_max=part_max,
               part_sum=part_sum, chunk_keys=3, **args)
    assert np.isneginf(part_max).any(), "the short sequences leave trailing chunks empty"
    out = np.full((batch.num_tokens, 4 * 80), np.nan, np.float32)
    lib.launch("attention_combine_f32", out=out, part_out=part_out, part_max=part_max, part_sum=part_sum,
               T=batch.num_tokens, H=4, hd=80, n_chunks=n_chunks)
    want = REF.attention(args["q"], pool, 0, batch, args["scale"], window)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def expected_draw(logits, temperature, top_k, top_p, min_p, seed, counter) -> int:
    """sample_f32's contract on the host: engine/sampling.py's filters, then the inverse CDF in id order
    at the uniform philox_uniform(seed, counter)."""
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float32) / np.float32(temperature)
    order = np.argsort(-scaled, kind="stable")
    weights = np.exp(scaled[order].astype(np.float64) - scaled[order[0]])
    keep = min(top_k, len(order)) if top_k > 0 else len(order)
    probs = weights[:keep] / weights[:keep].sum()
    if top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), top_p) + 1))
    if min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(probs >= min_p * probs[0]))))
    kept = np.zeros(len(logits), bool)
    kept[order[:keep]] = True
    mass = np.where(kept, np.exp(scaled.astype(np.float64) - scaled.max()), 0.0)
    u = philox_uniform(seed, counter) * mass.sum()
    return int(np.searchsorted(np.cumsum(mass), u, side="right"))


def sample(lib, logits, settings, threads=None, allowed_mask=None, mask_rows=None):
    """allowed_mask: int32 bitmask rows (pack_mask) or None; mask_rows: row -> mask row (-1 = none) or None."""
    rows = len(settings)
    column = lambda i, dtype: np.array([s[i] for s in settings], dtype=dtype)  # noqa: E731
    out_ids = np.full(rows, -1, np.int32)
    lib.launch("sample_f32", threads=threads, out_ids=out_ids, logits=logits, rows=rows, vocab=logits.shape[1],
               temperature=column(0, np.float32), top_k=column(1, np.int32), top_p=column(2, np.float32),
               min_p=column(3, np.float32), seeds=column(4, np.uint64), counters=column(5, np.int32),
               allowed_mask=allowed_mask, mask_words=0 if allowed_mask is None else allowed_mask.shape[1],
               mask_rows=None if mask_rows is None else np.asarray(mask_rows, np.int32))
    return out_ids


def pack_mask(allowed, words=None):
    """bool [n, vocab] -> int32 [n, words] in llguidance's layout: bit id % 32 of word id / 32 set = allowed."""
    words = words or mask_words(allowed.shape[1])
    packed = np.packbits(allowed, axis=1, bitorder="little")  # bit id % 8 of byte id / 8
    out = np.zeros((allowed.shape[0], words * 4), np.uint8)
    out[:, : packed.shape[1]] = packed
    return out.view("<u4").view(np.int32).copy()


def masked_draw(logits, allowed, *setting) -> int:
    """The masked contract on the host: disallowed logits set to -inf, then the unmasked contract."""
    return expected_draw(np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32), *setting)


def test_greedy_sampling_takes_the_lowest_id_among_ties(kernel_runner):
    logits = rand(3, 2053)
    logits[0, [5, 900, 2000]] = 9.0
    logits[1, [2052, 1030]] = 9.0
    out = sample(kernel_runner("sampling"), logits, [(0.0, 0, 1.0, 0.0, 1, 0)] * 3)
    assert out.tolist() == [5, 1030, int(np.argmax(logits[2]))]


SETTINGS = [  # temperature, top_k, top_p, min_p, seed, counter
    (1.0, 0, 1.0, 0.0, 7, 0), (0.7, 50, 1.0, 0.0, 7, 1), (1.3, 0, 0.9, 0.0, 11, 5), (1.0, 40, 0.5, 0.0, 3, 2),
    (1.0, 0, 1.0, 0.05, 3, 9), (2.0, 100, 0.95, 0.01, 2**40 + 5, 12345), (1.0, 1, 1.0, 0.0, 9, 4),
]


def test_sampling_draws_the_token_the_contract_says(kernel_runner):
    logits = rand(len(SETTINGS), 3001, seed=5) * 3
    out = sample(kernel_runner("sampling"), logits, SETTINGS)
    assert out.tolist() == [expected_draw(logits[i], *s) for i, s in enumerate(SETTINGS)]


def test_sampling_is_a_function_of_seed_and_counter(kernel_runner):
    logits = np.repeat(rand(1, 300, seed=6), 64, axis=0)
    settings = [(1.0, 0, 1.0, 0.0, 21, c) for c in range(64)]
    out = sample(kernel_runner("sampling"), logits, settings, threads=64)
    assert out.tolist() == [expected_draw(logits[0], *s) for s in settings]
    assert len(set(out.tolist())) > 10  # different counters, different draws


@pytest.mark.parametrize("top_k, top_p, min_p, kept", [
    (2, 1.0, 0.0, {200, 3}), (3, 1.0, 0.0, {200, 3, 77}), (0, 0.65, 0.0, {200, 3}), (0, 0.85, 0.0, {200, 3, 77}),
    (0, 1.0, 0.6, {200, 3}), (0, 1.0, 0.2, {200, 3, 77}), (4, 0.8, 0.0, {200, 3, 77}), (1, 1.0, 0.0, {200}),
])
def test_filters_keep_exactly_the_reference_set(kernel_runner, top_k, top_p, min_p, kept):
    logits = np.full((1, 257), -30.0, np.float32)
    logits[0, [200, 3, 77, 150, 9]] = np.log([0.4, 0.3, 0.2, 0.07, 0.03])
    settings = [(1.0, top_k, top_p, min_p, 5, c) for c in range(128)]
    out = sample(kernel_runner("sampling"), np.repeat(logits, 128, axis=0), settings, threads=32)
    assert set(out.tolist()) == kept


def test_sampling_all_masked_logits_still_gives_a_valid_id(kernel_runner):
    logits = np.full((2, 300), -np.inf, np.float32)
    out = sample(kernel_runner("sampling"), logits, [(0.0, 0, 1.0, 0.0, 1, 0), (1.0, 0, 1.0, 0.0, 1, 0)], threads=64)
    assert out.tolist() == [0, 0]


def test_masked_greedy_takes_the_best_allowed_token_lowest_id_on_ties(kernel_runner):
    logits = rand(4, 2053, seed=7)  # 2053 = 64 words + 5 bits: the last word is partial
    logits[:, 10] = 20.0  # the best token overall, disallowed wherever a mask applies
    logits[:, [33, 2052, 700]] = 9.0  # the best allowed ones, tied
    allowed = np.zeros((2, 2053), bool)
    allowed[0, ::7] = True  # lower tokens (not 10: 10 % 7 != 0) and the tied best
    allowed[0, [33, 700, 2052]] = True
    allowed[1, [2052, 1, 2]] = True
    mask_rows = [0, -1, 1, 0]  # rows 0 and 3 share mask row 0; row 1 is unconstrained
    out = sample(kernel_runner("sampling"), logits, [(0.0, 0, 1.0, 0.0, 1, 0)] * 4, allowed_mask=pack_mask(allowed),
                 mask_rows=mask_rows)
    assert out.tolist() == [33, 10, 2052, 33]


MASKED_SETTINGS = SETTINGS + [(0.0, 0, 1.0, 0.0, 1, 0), (0.5, 5, 0.8, 0.1, 17, 3)]


@pytest.mark.parametrize("density", [0.5, 0.02])  # 0.02: fewer allowed tokens (~20) than several top-k
def test_masked_sampling_draws_the_host_twins_token(kernel_runner, density):
    vocab, counters = 1001, 8
    settings = [(t, k, p, m, seed + c, counter + 31 * c) for c in range(counters)
                for t, k, p, m, seed, counter in MASKED_SETTINGS]
    rng = np.random.default_rng(11)
    logits = rand(len(settings), vocab, seed=8) * 3
    allowed = rng.random((len(settings), vocab)) < density
    allowed[:, rng.integers(vocab)] = True
    words = mask_words(vocab) + 3  # a padded row stride: only the first ceil(vocab / 32) words are read
    out = sample(kernel_runner("sampling"), logits, settings, threads=128, allowed_mask=pack_mask(allowed, words))
    want = [masked_draw(logits[i], allowed[i], *s) for i, s in enumerate(settings)]
    assert out.tolist() == want
    assert all(allowed[i, token] for i, token in enumerate(out))


def test_rows_without_a_mask_sample_as_before(kernel_runner):
    logits = rand(len(SETTINGS), 3001, seed=5) * 3
    lib = kernel_runner("sampling")
    unmasked = sample(lib, logits, SETTINGS)
    none_allowed = pack_mask(np.zeros((1, 3001), bool))  # would force id 0 on any row that used it
    assert sample(lib, logits, SETTINGS, allowed_mask=none_allowed, mask_rows=[-1] * len(SETTINGS)).tolist() \
        == unmasked.tolist()
    all_allowed = pack_mask(np.ones((len(SETTINGS), 3001), bool))
    assert sample(lib, logits, SETTINGS, allowed_mask=all_allowed).tolist() == unmasked.tolist()
    assert unmasked.tolist() == [expected_draw(logits[i], *s) for i, s in enumerate(SETTINGS)]


def test_a_mask_allowing_one_token_always_returns_it(kernel_runner):
    vocab = 77  # 2 full words and 13 bits
    only = [0, 31, 32, 76, 40, 5]
    logits = np.repeat(rand(1, vocab, seed=9) * 4, len(only) * 16, axis=0)
    logits[:, only] = -25.0  # the allowed token is the least likely one
    allowed = np.zeros((len(only), vocab), bool)
    allowed[np.arange(len(only)), only] = True
    mask = pack_mask(allowed)
    mask[:, -1] |= np.int32(-1 << 13)  # bits past the vocabulary are set, and must be ignored
    settings = [MASKED_SETTINGS[(j + c) % len(MASKED_SETTINGS)][:4] + (3, c) for j in range(len(only))
                for c in range(16)]
    out = sample(kernel_runner("sampling"), logits, settings, threads=32, allowed_mask=mask,
                 mask_rows=np.repeat(np.arange(len(only)), 16))
    assert out.tolist() == np.repeat(only, 16).tolist()


def test_a_mask_allowing_nothing_gives_id_zero_as_all_inf_logits_do(kernel_runner):
    logits = rand(2, 300, seed=10)
    out = sample(kernel_runner("sampling"), logits, [(0.0, 0, 1.0, 0.0, 1, 0), (1.0, 0, 1.0, 0.0, 1, 0)],
                 threads=64, allowed_mask=pack_mask(np.zeros((1, 300), bool)), mask_rows=[0, 0])
    assert out.tolist() == [0, 0]
