import numpy as np
import pytest

from engine.sampling import Sampler, SamplingParams
from engine.stop import StopStringMatcher


def _logits(*values):
    return np.array(values, dtype=np.float32)


def test_greedy_takes_argmax_and_lowest_id_on_ties():
    s = Sampler(SamplingParams(temperature=0))
    assert s.sample(_logits(1, 5, 5, 2)) == 1


def test_same_seed_same_tokens_different_seed_differs():
    logits = np.random.default_rng(0).normal(size=500).astype(np.float32)
    a = Sampler(SamplingParams(seed=7))
    b = Sampler(SamplingParams(seed=7))
    c = Sampler(SamplingParams(seed=8))
    seq_a = [a.sample(logits) for _ in range(30)]
    assert seq_a == [b.sample(logits) for _ in range(30)]
    assert seq_a != [c.sample(logits) for _ in range(30)]


def test_top_k_one_is_greedy():
    s = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=0))
    assert {s.sample(_logits(0, 3, 1, 2.9)) for _ in range(50)} == {1}


def test_top_p_keeps_smallest_prefix_reaching_mass():
    # probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.8 keeps ids 0 and 1 only
    logits = np.log(np.array([0.64, 0.24, 0.09, 0.03], dtype=np.float32))
    s = Sampler(SamplingParams(top_p=0.8, seed=3))
    assert {s.sample(logits) for _ in range(300)} == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_best():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    s = Sampler(SamplingParams(min_p=0.35, seed=3))  # keeps p >= 0.175: ids 0, 1
    assert {s.sample(logits) for _ in range(300)} == {0, 1}


def test_frequency_penalty_moves_greedy_off_a_repeated_token():
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=1.0))
    logits = _logits(3.0, 2.5)
    assert [s.sample(logits) for _ in range(3)] == [0, 1, 0]  # 3-1 < 2.5, then 2.5-1 < 2.0


def test_presence_penalty_applies_once_per_token():
    s = Sampler(SamplingParams(temperature=0, presence_penalty=0.6))
    logits = _logits(3.0, 2.0)
    assert [s.sample(logits) for _ in range(3)] == [0, 0, 0]  # 2.4 > 2.0 however often 0 repeats


def test_low_temperature_concentrates_on_the_best():
    s = Sampler(SamplingParams(temperature=0.05, seed=1))
    assert {s.sample(_logits(1.0, 2.0, 1.5)) for _ in range(100)} == {1}


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-6])
def test_a_vanishing_temperature_is_greedy_not_nan(temperature):
    # found by tests/test_openapi_fuzz.py: logits / 5e-324 overflowed to inf and the draw saw NaN probabilities
    s = Sampler(SamplingParams(temperature=temperature, presence_penalty=-0.1, seed=3))
    assert [s.sample(_logits(1.0, 2.0, 2.0, -3.0)) for _ in range(5)] == [1] * 5


def _penalised_reference(logits, generated, penalty, last_n, frequency=0.0):
    """llama.cpp's penalty_repeat by hand: each distinct token of the window, then the frequency penalty over
    every generated token (vLLM's order)."""
    out = logits.astype(np.float64)
    window = generated if last_n < 0 else generated[-last_n:] if last_n else []
    for token in set(window):
        out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    for token in set(generated):
        out[token] -= frequency * generated.count(token)
    return out


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0))
    assert [s.sample(_logits(3.0, 2.0)) for _ in range(3)] == [0, 1, 0]  # 3/2 < 2; then 1.5 > 2/2
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5))
    assert [s.sample(_logits(-1.0, -1.2, -3.0)) for _ in range(2)] == [0, 1]  # -1 * 1.5 < -1.2 (not -0.67)


def test_repetition_penalty_forgets_tokens_that_left_the_window():
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=10.0, repetition_last_n=2))
    assert [s.sample(_logits(3.0, 2.0, 1.0)) for _ in range(5)] == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("last_n", [-1, 0, 3, 64])
def test_repetition_penalty_matches_a_numpy_reference(last_n):
    rng = np.random.default_rng(5)
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=1.3, repetition_last_n=last_n,
                               frequency_penalty=0.2))
    generated = []
    for _ in range(60):
        logits = rng.normal(size=8).astype(np.float32)
        expected = int(np.argmax(_penalised_reference(logits, generated, 1.3, last_n, frequency=0.2)))
        assert s.sample(logits) == expected
        generated.append(expected)
    assert len(set(generated)) > 3  # the window held several tokens


def test_repetition_penalty_one_leaves_the_logits_alone():
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    plain, penalised = Sampler(SamplingParams(seed=4)), Sampler(SamplingParams(seed=4, repetition_penalty=1.0))
    assert [plain.sample(logits) for _ in range(30)] == [penalised.sample(logits) for _ in range(30)]


@pytest.mark.parametrize(
    "field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5), ("max_tokens", 0),
                    ("repetition_penalty", 0.0), ("repetition_last_n", -2)]
)
def test_invalid_params_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_string_split_across_deltas_is_held_back_and_cut():
    m = StopStringMatcher(["</answer>"])
    assert m.push("Paris</an") == "Paris"
    assert m.push("swer> tail") == ""
    assert m.stopped


def test_held_back_prefix_is_released_when_it_does_not_complete():
    m = StopStringMatcher(["STOP"])
    assert m.push("ab ST") == "ab "
    assert m.push("ory") == "STory"
    assert m.flush() == ""


def test_earliest_of_several_stops_wins():
    m = StopStringMatcher(["world", "lo"])
    assert m.push("hello world") == "hel"


# -- grammar masks (llguidance's bitmask layout: int32 words, bit j of word i allows token 32 * i + j) ------
def _bitmask(allowed_ids, vocab):
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    for i in allowed_ids:
        words[i // 32] |= np.uint32(1 << (i % 32))
    return words.view(np.int32)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=2.0, top_k=5, top_p=0.9, min_p=0.01),
    SamplingParams(temperature=0.7, presence_penalty=-2.0, frequency_penalty=-2.0),  # pulls repeats *up*
])
def test_sampler_never_picks_a_masked_token(params):
    vocab, rng = 1000, np.random.default_rng(1)
    sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": 5}))
    for step in range(200):
        allowed = rng.choice(vocab, size=int(rng.integers(1, 40)), replace=False)
        logits = rng.normal(size=vocab).astype(np.float32)
        logits[np.setdiff1d(np.arange(vocab), allowed)[:50]] = 50.0  # the best logits are all disallowed
        assert sampler.sample(logits, _bitmask(allowed, vocab)) in set(allowed.tolist())


def test_greedy_under_a_mask_is_the_best_allowed_token_lowest_id_on_ties():
    s = Sampler(SamplingParams(temperature=0))
    assert s.sample(_logits(9, 5, 7, 7, 1), _bitmask([1, 2, 3, 4], 5)) == 2
    assert s.sample(_logits(9, 5, 7, 7, 1), _bitmask([4], 5)) == 4


def test_temperature_draws_only_and_all_allowed_tokens():
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    logits = np.zeros(70, dtype=np.float32)
    assert {s.sample(logits, _bitmask([3, 33, 64], 70)) for _ in range(300)} == {3, 33, 64}


def test_tokens_past_the_mask_are_disallowed_and_an_empty_mask_raises():
    s = Sampler(SamplingParams(temperature=0))
    logits = np.zeros(40, dtype=np.float32)
    logits[35] = 10.0  # the model's rows may be wider than the vocabulary the mask covers
    assert s.sample(logits, _bitmask([2], 32)) == 2
    with pytest.raises(ValueError, match="allows no token"):
        s.sample(logits, _bitmask([], 40))


def test_allowed_tokens_with_only_minus_inf_logits_still_returns_an_allowed_one():
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=0)):
        logits = np.full(64, -np.inf, dtype=np.float32)
        logits[0] = 1.0
        assert Sampler(params).sample(logits, _bitmask([40, 50], 64)) == 40


def _full_sort_draws(logits, params, n):
    """The draw as a sort of the whole vocabulary computes it (the reference _nucleus and top_k's partition
    must agree with): n tokens from one seeded generator."""
    rng = np.random.default_rng(params.seed)
    scaled = logits.astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    if 0 < params.top_k < len(order):
        order = order[: params.top_k]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    keep = len(order)
    if params.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p) + 1))
    if params.min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(probs >= params.min_p * probs[0]))))
    probs = probs[:keep] / probs[:keep].sum()
    return [int(order[rng.choice(keep, p=probs)]) for _ in range(n)]


@pytest.mark.parametrize("fields", [dict(top_k=0, top_p=0.9), dict(top_k=0, top_p=0.999), dict(top_k=0, min_p=0.2),
                                    dict(top_k=0, top_p=0.95, min_p=0.01), dict(top_k=40, top_p=0.95, min_p=0.05),
                                    dict(top_k=0), dict(top_k=3000, top_p=0.5)])
@pytest.mark.parametrize("spread", [0.5, 4.0], ids=["flat", "peaked"])
def test_the_draw_equals_a_sort_of_the_whole_vocabulary(fields, spread):
    """The sampler sorts only the head of the distribution the filters can keep; the tokens drawn are those
    of a full sort with the same seed (flat logits make top_p's head grow past its first tries)."""
    logits = (np.random.default_rng(5).standard_normal(50_000) * spread).astype(np.float32)
    params = SamplingParams(temperature=0.8, seed=11, **fields)
    sampler = Sampler(params)
    assert [sampler.sample(logits) for _ in range(40)] == _full_sort_draws(logits, params, 40)
