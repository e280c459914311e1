"""The state window (engine/state_window.py) on the tiny lfm2, without the cache: the runner alone.

One sequence (the reference) computes a prompt in chunks; a second one gets byte copies of the reference's
K/V blocks for positions < P, zero states and a window of w tokens before P, then continues. Checked: the
conv states at P are exact (to float rounding) exactly where the bound says, row by row, and not one token
earlier; the logits after the window equal the reference's within a measured bound; the window writes no
K/V (and had it written, it would have put wrong values into the shared blocks).
"""
from types import SimpleNamespace

import numpy as np
import pytest

from engine.backends.capabilities import Capabilities
from engine.backends.reference.backend import NumpyBackend
from engine.model import load_model
from engine.recurrent_state import RecurrentStates
from engine.sequence import ModelRunner, Sequence
from engine.short_conv import ConvStatePool
from engine.state_window import state_window_tokens
from tests.support.hybrid_runs import LOGIT_BOUND, STATE_BOUND
from tests.support.tiny_lfm2 import write_tiny_lfm2

BLOCK, CHUNK, P = 4, 8, 37  # P inside a block: the window reads a partly filled one too
TOKENS = [int(t) for t in np.random.default_rng(0).integers(3, 270, 60)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("window") / "tiny-lfm2.gguf"
    write_tiny_lfm2(path, seed=4, n_ctx=256)  # c c a c a, L = 3
    return load_model(path, NumpyBackend())[0]


def _steps(runner, seq, end):
    rows = []
    while seq.num_computed < end:
        rows.append(runner.step([(seq, min(CHUNK, end - seq.num_computed))])[0])
    return rows


def _window_run(model, window: int):
    """(reference state at P, windowed state at P, reference logits after P, windowed logits, the copied
    blocks' (K, V) before and after the windowed sequence ran)."""
    runner = ModelRunner(model, 64, BLOCK)
    ref, win = Sequence(list(TOKENS)), Sequence(list(TOKENS))
    runner.ensure_blocks(ref, len(TOKENS))
    runner.ensure_blocks(win, len(TOKENS))
    _steps(runner, ref, P)
    want_state = runner.states.read(ref)
    used = -(-P // BLOCK)
    for a, b in zip(ref.block_table[:used], win.block_table[:used]):  # as a restore or copy-on-write does
        runner.write_block(b, *runner.read_block("device", a))
    before = [runner.read_block("device", b) for b in win.block_table[:used]]
    want_rows = _steps(runner, ref, len(TOKENS))
    win.num_computed = P
    runner.states.write(win, np.zeros(runner.states.shape, np.float32))
    win.state_window = window  # what RecurrentStates.start_window sets (with window_tokens)
    runner.states.capture(win, (P,))
    rows = [runner.step([(win, CHUNK)])[0]]
    assert win.state_window == 0 and win.num_computed == P + CHUNK
    got_state = runner.states.take_captured(win)[P]
    rows += _steps(runner, win, len(TOKENS))
    after = [runner.read_block("device", b) for b in win.block_table[:used]]
    return want_state, got_state, want_rows, rows, before, after


def test_the_window_is_conv_layers_times_kernel_minus_one(model):
    assert state_window_tokens(model.config) == 3 * (3 - 1)
    assert ModelRunner(model, 8, BLOCK).states.window_tokens == 6


def test_each_state_row_is_exact_exactly_from_the_window_the_bound_gives(model):
    """Conv layer j's (1-based) state row r (position P - 2 + r) is exact iff w >= j (L - 1) - r: the
    zero start's error moves L - 1 positions per conv layer. So w = 6 makes every row exact and w = 5 leaves
    the last layer's oldest row wrong: one token short fails."""
    rows = 2
    for window in range(1, 9):
        want, got, *_ = _window_run(model, window)
        error = np.abs(want - got).max(axis=2)  # [conv layers, L - 1]
        for j in range(3):
            for r in range(rows):
                exact = window >= (j + 1) * rows - r
                assert (error[j, r] <= STATE_BOUND) == exact, (window, j, r, error[j, r])
                if not exact:
                    assert error[j, r] > 100 * STATE_BOUND, (window, j, r, error[j, r])


def test_logits_after_the_window_equal_the_reference_within_rounding(model):
    want_state, got_state, want_rows, rows, _, _ = _window_run(model, 6)
    assert np.abs(want_state - got_state).max() <= STATE_BOUND
    scale = max(np.abs(r).max() for r in want_rows)
    for want, got in zip(want_rows, rows, strict=True):
        assert np.abs(want - got).max() <= LOGIT_BOUND * scale
        assert int(np.argmax(want)) == int(np.argmax(got))


def test_one_token_short_changes_the_logits(model):
    """w = 5: 5.1e-4 of the logit scale measured (1800x the rounding of w = 6), past the bound by 50x."""
    want_state, got_state, want_rows, rows, _, _ = _window_run(model, 5)
    scale = max(np.abs(r).max() for r in want_rows)
    assert max(np.abs(w - g).max() for w, g in zip(want_rows, rows)) > 10 * LOGIT_BOUND * scale


def test_the_window_writes_no_k_v(model):
    """The blocks of positions < P hold exactly the bytes they held before the window ran (the shared
    blocks of the cache: a window that wrote would put its early rows' wrong K/V there)."""
    *_, before, after = _window_run(model, 6)
    for block, ((k0, v0), (k1, v1)) in enumerate(zip(before, after)):
        keys = slice(0, min(BLOCK, P - block * BLOCK))  # [layers, KVH, B, row]: positions < P only
        np.testing.assert_array_equal(k1[:, :, keys], k0[:, :, keys])
        np.testing.assert_array_equal(v1[:, :, keys], v0[:, :, keys])


def test_the_window_s_own_k_v_of_its_early_rows_is_wrong(model):
    """Why the window must not write: its K/V at P - 6 .. differ from the cached (true) ones."""
    runner = ModelRunner(model, 64, BLOCK)
    ref, win = Sequence(list(TOKENS)), Sequence(list(TOKENS))
    runner.ensure_blocks(ref, P)
    runner.ensure_blocks(win, P)
    _steps(runner, ref, P)
    win.num_computed = P - 6  # the window's rows as an ordinary step from zero states (it writes)
    runner.states.write(win, np.zeros(runner.states.shape, np.float32))
    for a, b in zip(ref.block_table, win.block_table):
        runner.write_block(b, *runner.read_block("device", a))
    runner.step([(win, 6)])
    first = P - 6  # position 31: block 7, slot 3
    k_ref, _ = runner.read_block("device", ref.block_table[first // BLOCK])
    k_win, _ = runner.read_block("device", win.block_table[first // BLOCK])
    assert np.abs(k_ref[:, :, first % BLOCK] - k_win[:, :, first % BLOCK]).max() > 1e-2


def test_backends_without_row_writes_and_delta_nets_have_no_window(model):
    """A backend whose store_kv writes every row (no `writes_kv_rows`; numpy and CUDA both have it) keeps
    checkpoints only; a qwen3next config (gated DeltaNet, unbounded memory) has no window at all."""
    stage = SimpleNamespace(layers=range(model.config.n_layers), backend=SimpleNamespace(capabilities=Capabilities(), create_state_pool=ConvStatePool),
                            state_pool=None)
    assert RecurrentStates(model.config, [stage]).window_tokens == 0
    delta = SimpleNamespace(delta_net=object(), is_hybrid=True, conv_kernel=4, recurrent_layers=(0, 1))
    assert state_window_tokens(delta) == 0
