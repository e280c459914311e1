"""State windows in the conversation cache (engine/state_window.py), through the engine loop on the tiny
lfm2 (6-token window: 3 conv layers, L = 3), `check_integrity` after every admission and step.

A prompt whose K/V match ends more than a window past the nearest checkpoint reuses the K/V up to its end
and recomputes the state there from the window; its usage counts the window as computed. Cache on == off
on branching workloads under pressure; the logits of a windowed request equal cache off's within the
rounding bound of tests/test_state_window.py; the log says what happened.
"""
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from scheduler.cache.hybrid_steps import HybridSteps
from tests.support.hybrid_runs import LOGIT_BOUND, open_hybrid, run_turns

WINDOW = 6


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """The tiny lfm2 of tests/test_hybrid_cache.py, whose window and checkpoint positions these tests expect."""
    return open_hybrid("lfm2", tmp_path_factory.mktemp("lfm2-only"))


def _branching_turns(seed: int, count: int = 24, conversations: int = 6):
    """Conversations that open with a random-length head of one shared document (so prompts branch inside
    it, mostly far from a checkpoint), then continue with their own turns."""
    rng = np.random.default_rng(seed)
    document = rng.integers(3, 250, size=90).tolist()
    started, turns = set(), []
    for _ in range(count):
        conv = int(rng.integers(conversations))
        user = rng.integers(3, 250, size=int(rng.integers(1, 12))).tolist()
        if conv not in started:
            started.add(conv)
            user = document[: int(rng.integers(10, 90))] + user
        turns.append((conv, user, int(rng.integers(1, 7))))
    return turns


@pytest.mark.parametrize("seed,pressure", [(0, "none"), (1, "host"), (2, "disk"), (3, "disk"), (0, "preempt")])
def test_cache_on_and_off_produce_identical_replies_with_windows(lfm2, seed, pressure, tmp_path):
    turns = _branching_turns(seed)
    extra = {"none": {}, "host": dict(num_blocks=60, host_blocks=20),
             "disk": dict(num_blocks=60, host_blocks=8, disk_root=tmp_path, disk_blocks=400),
             "preempt": dict(num_blocks=36, host_blocks=40)}[pressure]
    on, usage, _, loop, _ = run_turns(lfm2, turns, concurrency=3, every=8, **extra)
    off, _, _, _, _ = run_turns(lfm2, turns, cache_on=False, concurrency=3, num_blocks=60)
    assert on == off
    assert loop.cache.stats["state_windows"] > 0
    if pressure != "none":
        assert loop.cache.stats["parks"] > 0
    if pressure == "preempt":  # a 36-block pool preempts running requests (they resume by their match)
        assert loop.num_preemptions > 0


def test_windows_through_pipeline_stages_and_batch_groups(lfm2):
    """Three stages (each its share of the conv states; the window's rows skip every stage's K/V store) and
    three groups in flight."""
    turns = _branching_turns(4, count=15)
    on, _, _, loop, _ = run_turns(lfm2, turns, concurrency=3, every=8, layer_split=(1, 3), groups=3)
    off, _, _, _, _ = run_turns(lfm2, turns, cache_on=False, concurrency=3)
    assert on == off and loop.cache.stats["state_windows"] > 0


def test_a_branch_far_from_a_checkpoint_reuses_the_k_v_and_computes_the_window(lfm2):
    """37 shared tokens, no checkpoint before them (every=0): the second prompt reuses 37 tokens of K/V,
    computes its 6-token window plus its own 2 tokens, and reports 31 cached; its logits equal cache off's
    within the rounding bound and its replies are the same."""
    shared = list(range(30, 67))
    turns = [(0, shared + [200, 201, 202, 203, 204], 3), (1, shared + [210, 211], 3)]
    on, usage, steps, loop, _ = run_turns(lfm2, turns, every=0)
    off, _, steps_off, _, _ = run_turns(lfm2, turns, every=0, cache_on=False)
    assert on == off
    assert usage[1][1] == 37 - WINDOW and loop.cache.stats["state_windows"] == 1
    first_step = [n for rid, n, _, _ in steps if rid == "t1"][0]
    assert first_step == 2  # the prompt's last 2 tokens; the window's 6 rows ran with them
    rows = [row for rid, _, row, _ in steps if rid == "t1"][-3:]  # the rows that sampled the reply
    want = [row for rid, _, row, _ in steps_off if rid == "t1"][-3:]
    scale = max(np.abs(r).max() for r in want)
    for got, ref in zip(rows, want, strict=True):
        assert np.abs(got - ref).max() <= LOGIT_BOUND * scale


@pytest.mark.parametrize("shared_len, cached, windows", [(37, 32, 0), (38, 32, 0), (39, 39 - WINDOW, 1)])
def test_a_branch_near_a_checkpoint_restores_it_instead(lfm2, shared_len, cached, windows):
    """The K/V match ends 5, 6 or 7 tokens past a checkpoint (at 32, every 2 blocks of 4): restoring it and
    computing 5 costs less than a 6-token window, 6 the same (the checkpoint: bitwise exact), 7 more."""
    shared = list(range(30, 30 + shared_len))
    turns = [(0, shared + [200, 201, 202, 203, 204], 2), (1, shared + [210, 211], 2)]
    _, usage, _, loop, _ = run_turns(lfm2, turns, every=2)
    assert usage[1][1] == cached and loop.cache.stats["state_windows"] == windows


def test_the_log_says_the_state_came_from_a_window(lfm2, caplog):
    shared = list(range(30, 67))
    turns = [(0, shared + [200, 201], 2), (1, shared + [210, 211], 2), (2, shared[:20] + [5, 6], 2)]
    with caplog.at_level(logging.INFO, logger="strata"):
        _, usage, _, _, _ = run_turns(lfm2, turns, every=0, hints={0: (11,)})
    assert [c for _, c, _ in usage] == [0, 37 - WINDOW, 20 - WINDOW]
    lines = [r.getMessage() for r in caplog.records if "window" in r.getMessage()]
    assert lines == [
        "restored the K/V of 37 cached tokens (state recomputed from a 6-token window at 37; the nearest state "
        "checkpoint is at token 11)",
        "restored the K/V of 20 cached tokens (state recomputed from a 6-token window at 20; the nearest state "
        "checkpoint is at token 11)"]


def test_a_request_preempted_before_its_window_ran_leaves_no_state(lfm2):
    """Its state slot holds the window's zeros, not the state at num_computed: no checkpoint from it."""
    hybrid = HybridSteps(SimpleNamespace(states=SimpleNamespace(enabled=True)),
                         SimpleNamespace(enabled=True, ckpt=SimpleNamespace(enabled=True)))
    waiting = SimpleNamespace(seq=SimpleNamespace(num_computed=37, state_window=WINDOW))
    assert hybrid.final_state(waiting) is None
